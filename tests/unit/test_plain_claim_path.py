"""One claim, one pass (docs/architecture.md, "One claim's prepare, one pass"): a plain
whole-GPU claim's prepare and unprepare, traced on the mock, enter the modules of the
stages and of the journal, the config and CDI, and no feature's code: nothing of MPS,
MIG, time-slicing or NVML, and the prepare no unprepare code. A claim that uses a
feature (a dynamic MIG device, an MPS daemon) does enter it, so the trace sees them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from driver.devices.model import PoolOptions
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef
from tests.state_fakes import node_state

DRIVER, NODE = "gpu.example.com", "node-a"
DRIVER_DIR = Path(__file__).resolve().parents[2] / "driver"
FEATURES = (
    "state/mps/",
    "state/mig_instances.py",
    "state/claim_timeslices.py",
    "state/mps_watch.py",
    "nvml/",
)


class Claims:
    def __init__(self) -> None:
        self.devices: dict[str, str] = {}
        self.config: list[dict[str, Any]] = []

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        result = {"request": "r0", "driver": DRIVER, "pool": NODE, "device": self.devices[name]}
        return {
            "metadata": {"namespace": namespace, "name": name, "uid": name},
            "status": {"allocation": {"devices": {"results": [result], "config": self.config}}},
        }


def _entered(run: Callable[[], object]) -> list[str]:
    """The driver modules (paths under driver/) whose functions `run` calls, in order."""
    seen: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(DRIVER_DIR):
                seen.setdefault(path.relative_to(DRIVER_DIR).as_posix(), None)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return list(seen)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[DeviceState, Claims]]:
    fleet = parse_fleet(
        {
            "gpus": [
                {"model": "H100-80GB", "count": 1, "migMode": "disabled"},
                {"model": "A100-40GB", "count": 1, "migMode": "enabled"},
            ]
        }
    )
    backend = MockBackend(MockNvml(fleet, NODE, driver_root=tmp_path / "root"))
    claims = Claims()
    state, _ = node_state(tmp_path, claims, backend, PoolOptions())
    yield state, claims


def _claim(claims: Claims, uid: str, device: str) -> ClaimRef:
    claims.devices[uid] = device
    return ClaimRef("default", uid, uid)


def test_a_plain_claims_prepare_and_unprepare_enter_no_features_code(
    node: tuple[DeviceState, Claims],
) -> None:
    state, claims = node
    warm = _claim(claims, "warm", "gpu-0")  # first calls: imports, caches
    assert state.prepare([warm])["warm"].ok
    assert state.unprepare([warm]) == {"warm": None}

    ref = _claim(claims, "plain", "gpu-0")
    prepare = _entered(lambda: state.prepare([ref]))
    unprepare = _entered(lambda: state.unprepare([ref]))
    print(f"prepare: {len(prepare)} modules {prepare}")
    print(f"unprepare: {len(unprepare)} modules {unprepare}")
    for modules in (prepare, unprepare):
        assert not [m for m in modules if m.startswith(FEATURES)], modules
    assert "state/teardown.py" not in prepare
    stages = ["state/prepare.py", "state/request.py", "state/plan.py", "state/commit.py"]
    assert [m for m in prepare if m in stages] == stages  # in order, each once entered
    assert "cdi/claim_specs.py" in prepare and "state/journal/checkpoint.py" in prepare
    # Error paths only: a valid claim builds no field path (driver/config/loader.py).
    assert "config/loader.py" not in prepare, prepare
    # The walk docs/architecture.md counts; a module more on it is a choice, said there.
    assert len(prepare) <= 21 and len(unprepare) <= 11, (prepare, unprepare)


def test_a_claim_that_uses_a_feature_enters_its_code(node: tuple[DeviceState, Claims]) -> None:
    """The trace sees feature modules where a claim needs them: a dynamic MIG device."""
    state, claims = node
    mig = next(n for n, d in state.devices.items() if d.profile is not None)
    ref = _claim(claims, "mig", mig)
    prepare = _entered(lambda: state.prepare([ref]))
    assert "state/mig_instances.py" in prepare, prepare
    unprepare = _entered(lambda: state.unprepare([ref]))
    assert "state/mig_instances.py" in unprepare, unprepare
