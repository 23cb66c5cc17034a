"""The mock NVML answers the probe's calls (tests/nvml_probe.py) as this host's GPU
does: a mock node with one GPU of the same model, MIG mode and driver version is asked
the same calls; every answer must match. A mismatch is a mock bug (record the host's
transcript with `python -m tests.nvml_probe FILE` into tests/data/ and fix the mock)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driver.nvml.mock.fleet import load_fleet, model_profiles
from driver.nvml.mock.nvml import MockNvml
from tests.nvml_probe import probe

REPO = Path(__file__).resolve().parents[2]


def test_the_mock_answers_the_probe_as_this_gpu_does(tmp_path: Path) -> None:
    # A process of its own: this one has NVML initialised already, and the probe asks
    # what a call answers before nvmlInit and after nvmlShutdown.
    transcript = tmp_path / "transcript.json"
    subprocess.run(
        [sys.executable, "-m", "tests.nvml_probe", str(transcript)], cwd=REPO, check=True
    )
    real = json.loads(transcript.read_text())
    gpu = real["gpu"]
    models = [key for key, model in model_profiles().items() if model.productName == gpu["name"]]
    if not models:
        pytest.skip(f"the mock has no model of this host's GPU ({gpu['name']})")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"gpus:\n- model: {models[0]}\n  count: 1\n"
        f"  migMode: {'enabled' if gpu['mig_mode'] else 'disabled'}\n"
        f"driverVersion: '{gpu['driver']}'\n"
    )
    mock = probe(MockNvml(load_fleet(fleet), "parity-node"))
    print(transcript.read_text())
    differing = {
        call: {"gpu": answer, "mock": mock.get(call)}
        for call, answer in real["answers"].items()
        if mock.get(call) != answer
    }
    assert not differing, json.dumps(differing, indent=1)
