"""The mock answers the probe's NVML calls as a real GPU did: the transcript in
tests/data was recorded with tests/nvml_probe.py on a real GPU (docs/gpu-testing.md
says which run), and the mock, given a fleet of the same model, MIG mode and driver,
must give every call the same answer (value, shape or NVML error)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.mock.fleet import load_fleet, model_profiles
from driver.nvml.mock.nvml import MockNvml
from tests.nvml_probe import probe

TRANSCRIPTS = sorted((Path(__file__).parents[1] / "data").glob("nvml-probe-*.json"))


def _mock_like(gpu: dict[str, Any], tmp_path: Path) -> MockNvml:
    """A mock node with one GPU of the recorded GPU's model, MIG mode and driver."""
    models = [key for key, model in model_profiles().items() if model.productName == gpu["name"]]
    assert models, f"the mock has no model named {gpu['name']}"
    fleet = tmp_path / "fleet.yaml"
    mig = "enabled" if gpu["mig_mode"] else "disabled"
    fleet.write_text(
        f"gpus:\n- model: {models[0]}\n  count: 1\n  migMode: {mig}\n"
        f"driverVersion: '{gpu['driver']}'\n"
    )
    return MockNvml(load_fleet(fleet), "parity-node")


@pytest.mark.parametrize("transcript", TRANSCRIPTS, ids=lambda p: p.stem)
def test_the_mock_answers_each_probe_call_as_the_recorded_gpu_did(
    transcript: Path, tmp_path: Path
) -> None:
    recorded = json.loads(transcript.read_text())
    answers = probe(_mock_like(recorded["gpu"], tmp_path))
    differing = {
        call: {"gpu": want, "mock": answers.get(call)}
        for call, want in recorded["answers"].items()
        if answers.get(call) != want
    }
    assert not differing, json.dumps(differing, indent=1)


def test_a_transcript_is_there() -> None:
    assert TRANSCRIPTS, "no recorded NVML transcript under tests/data"
