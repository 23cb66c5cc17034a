"""What the plugin's start loads: the strict GpuConfig decoder (pydantic) only for a
claim that carries this driver's opaque config; neither the start on the mock (its
fleet files are decoded without pydantic) nor a prepare of a plain claim needs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = "gpu.example.com"
RESULT = {"request": "gpu", "driver": DRIVER, "pool": "n", "device": "gpu-0"}
OPAQUE = {
    "source": "FromClaim",
    "requests": ["gpu"],
    "opaque": {
        "driver": DRIVER,
        "parameters": {
            "apiVersion": "gpu.resource.example.com/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        },
    },
}


# Run in a new interpreter from the repository root; argv[1]: the allocation (JSON).
START_AND_RESOLVE = f"""
import json, sys
from driver.plugin import main  # everything the start imports
yaml_at_start = "yaml" in sys.modules  # the mock's fleet files below are YAML
from driver.nvml.selection import check_mock_fleet, select_backend
from driver.config import resolve_configs

check_mock_fleet("default")
select_backend(mock=True, fleet_path="default", node_name="n").discover()
started = sorted(m for m in sys.modules if m.split(".")[0] == "pydantic")
configs = resolve_configs(json.loads(sys.argv[1]), {DRIVER!r})
print(json.dumps({{
    "pydantic_at_start": started,
    "yaml_at_start": yaml_at_start,
    "pydantic_after_resolve": "pydantic" in sys.modules,
    "interval": str(configs["gpu"].interval),
}}))
"""


def _start_and_resolve(allocation: dict[str, object]) -> dict[str, object]:
    command = [sys.executable, "-c", START_AND_RESOLVE, json.dumps(allocation)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_start_on_the_mock_and_a_plain_claim_do_not_load_pydantic() -> None:
    got = _start_and_resolve({"devices": {"results": [RESULT]}})
    assert got["pydantic_at_start"] == []
    assert got["pydantic_after_resolve"] is False
    assert got["interval"] == "Default"


def test_a_claim_with_opaque_config_is_still_decoded_strictly() -> None:
    got = _start_and_resolve({"devices": {"results": [RESULT], "config": [OPAQUE]}})
    assert got["pydantic_at_start"] == []
    assert got["pydantic_after_resolve"] is True
    assert got["interval"] == "Long"


def test_the_plugins_imports_do_not_load_yaml() -> None:
    """PyYAML is for kubeconfig files; an in-cluster plugin reads none (docs/benchmarks.md,
    "Where the time and memory go")."""
    assert _start_and_resolve({"devices": {"results": [RESULT]}})["yaml_at_start"] is False
