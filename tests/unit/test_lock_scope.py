"""The node lock covers what must be serialised, not the NVML calls that create and
destroy MIG devices (docs/state.md, "Locking").

On a real H100 a GPU-instance create or destroy takes hundreds of milliseconds to
seconds; the mock takes as long as `MockNvml.mig_latency` says. A prepare or
unprepare that needs no NVML call must not wait for one in flight, while every
guarantee the lock gave stays: no double booking, no claim prepared and torn down at
the same time, no rollback of a prepare still in flight.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from driver.state.checkpoint import Checkpoint, ClaimState
from driver.state.prepare import DeviceState
from tests.state_fakes import Healthy, NoReports
from tests.unit.test_crash_safety import UID_A, _crash, _live_mig, _root, _state
from tests.unit.test_mig_prepare import Node, make_node

LATENCY = 1.0  # seconds per GPU-instance create or destroy, as on a real GPU
# gpu-0 and gpu-1 in dynamic MIG mode, gpu-2 a plain GPU.
FLEET = {
    "gpus": [
        {"model": "H100-80GB", "count": 2},
        {"model": "H100-80GB", "count": 1, "migMode": "disabled"},
    ]
}


@pytest.fixture
def node(tmp_path: Path) -> Node:
    node = make_node(tmp_path, FLEET)
    node.mock.mig_latency = LATENCY
    return node


class Background:
    """A call on another thread, started once the mock's NVML `call` has begun on it."""

    def __init__(self, node: Node, call: str, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.finished_at = 0.0
        seen = node.mock.calls[call]

        def run() -> None:
            self.result = fn()
            self.finished_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while node.mock.calls[call] == seen:
            assert time.monotonic() < deadline, f"{call} never started"
            time.sleep(0.002)

    def join(self) -> Any:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        return self.result


CREATE = "nvmlDeviceCreateGpuInstanceWithPlacement"
DESTROY = "nvmlGpuInstanceDestroy"


def test_a_whole_gpu_prepare_does_not_wait_for_a_mig_create_in_flight(node: Node) -> None:
    mig = node.claims.add("mig", "gpu-0-mig-1g10gb-0")
    whole = node.claims.add("whole", "gpu-2")
    creating = Background(node, CREATE, lambda: node.state.prepare([mig]))

    started = time.monotonic()
    res = node.state.prepare([whole])["whole"]
    took = time.monotonic() - started

    assert res.ok, res.error
    assert took < LATENCY / 2, f"the whole-GPU prepare waited {took:.3f}s for the MIG create"
    assert creating.thread.is_alive(), "the MIG create was no longer in flight"
    assert creating.join()["mig"].ok
    journal = Checkpoint(node.root / "plugin").load()
    assert {uid: e.state for uid, e in journal.items()} == {
        "mig": ClaimState.PREPARE_COMPLETED,
        "whole": ClaimState.PREPARE_COMPLETED,
    }
    assert set(node.state.cdi.list_claim_specs()) == {"mig", "whole"}


def test_a_whole_gpu_prepare_does_not_wait_for_a_mig_destroy_in_flight(node: Node) -> None:
    mig = node.claims.add("mig", "gpu-0-mig-1g10gb-0")
    node.mock.mig_latency = 0
    assert node.state.prepare([mig])["mig"].ok
    node.mock.mig_latency = LATENCY
    whole = node.claims.add("whole", "gpu-2")
    destroying = Background(node, DESTROY, lambda: node.state.unprepare([mig]))

    started = time.monotonic()
    res = node.state.prepare([whole])["whole"]
    took = time.monotonic() - started

    assert res.ok, res.error
    assert took < LATENCY / 2, f"the whole-GPU prepare waited {took:.3f}s for the MIG destroy"
    assert destroying.thread.is_alive(), "the MIG destroy was no longer in flight"
    assert destroying.join() == {"mig": None}
    assert node.live() == []
    assert set(Checkpoint(node.root / "plugin").load()) == {"whole"}


def test_mig_creates_on_two_gpus_run_side_by_side(node: Node) -> None:
    a = node.claims.add("a", "gpu-0-mig-1g10gb-0")
    b = node.claims.add("b", "gpu-1-mig-1g10gb-0")
    started = time.monotonic()
    first = Background(node, CREATE, lambda: node.state.prepare([a]))
    second = node.state.prepare([b])["b"]
    assert second.ok, second.error
    assert first.join()["a"].ok
    took = time.monotonic() - started
    assert took < 1.6 * LATENCY, f"two creates on two GPUs took {took:.3f}s: one after the other"


@pytest.mark.parametrize(
    "wanted", ["gpu-0-mig-1g10gb-0", "gpu-0-mig-2g20gb-0", "gpu-0"], ids=["same", "overlap", "gpu"]
)
def test_two_mig_prepares_for_one_placement_never_double_book(node: Node, wanted: str) -> None:
    """The second arrives while the first one's create is in flight."""
    first = node.claims.add("first", "gpu-0-mig-1g10gb-0")
    second = node.claims.add("second", wanted)
    creating = Background(node, CREATE, lambda: node.state.prepare([first]))
    refused = node.state.prepare([second])["second"]
    assert creating.join()["first"].ok
    assert refused.error is not None and not refused.error.permanent
    assert "first" in str(refused.error) and "overlaps" in str(refused.error)
    assert [m.placement for m in node.live()] == [(0, 1)]
    assert set(Checkpoint(node.root / "plugin").load()) == {"first"}
    assert set(node.state.cdi.list_claim_specs()) == {"first"}


def test_a_prepare_waits_for_the_unprepare_in_flight_that_frees_its_device(node: Node) -> None:
    """The device is freed by an unprepare whose destroy is in flight: the new claim
    gets it once the destroy is done, not a refusal the kubelet must retry."""
    old = node.claims.add("old", "gpu-0-mig-1g10gb-0")
    node.mock.mig_latency = 0
    assert node.state.prepare([old])["old"].ok
    node.mock.mig_latency = LATENCY
    new = node.claims.add("new", "gpu-0-mig-1g10gb-0")
    destroying = Background(node, DESTROY, lambda: node.state.unprepare([old]))
    res = node.state.prepare([new])["new"]
    assert destroying.join() == {"old": None}
    assert res.ok, res.error
    assert [m.placement for m in node.live()] == [(0, 1)]
    assert set(Checkpoint(node.root / "plugin").load()) == {"new"}


def test_an_unprepare_of_a_claim_whose_prepare_is_in_flight_waits_for_it(node: Node) -> None:
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    creating = Background(node, CREATE, lambda: node.state.prepare([ref]))
    assert node.state.unprepare([ref]) == {"u": None}
    assert creating.join()["u"].ok  # it was prepared, then unprepared
    assert node.live() == []
    assert Checkpoint(node.root / "plugin").load() == {}
    assert set(node.state.cdi.list_claim_specs()) == set()


def test_the_wait_for_a_request_in_flight_is_bounded_by_the_lock_timeout(node: Node) -> None:
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    node.state.lock.timeout = LATENCY / 5
    creating = Background(node, CREATE, lambda: node.state.prepare([ref]))
    error = node.state.unprepare([ref])["u"]
    assert creating.thread.is_alive()
    assert error is not None and not error.permanent
    assert "claim u is still in progress" in str(error)
    assert creating.join()["u"].ok  # untouched by the unprepare that gave up
    assert Checkpoint(node.root / "plugin").load()["u"].state is ClaimState.PREPARE_COMPLETED


def test_a_repeated_prepare_of_a_claim_in_flight_answers_as_the_first(node: Node) -> None:
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    creating = Background(node, CREATE, lambda: node.state.prepare([ref]))
    again = node.state.prepare([ref])["u"]
    first = creating.join()["u"]
    assert first.ok and again.ok, (first.error, again.error)
    assert again.devices == first.devices
    assert len(node.live()) == 1
    assert node.state.stats.rollbacks == 0


def test_a_starting_instance_leaves_a_prepare_in_flight_alone(node: Node) -> None:
    """A rolling update: the new instance's start-up recovery runs while the old one
    creates a MIG device. Its `PrepareStarted` entry is not a crash's leftover."""
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    creating = Background(node, CREATE, lambda: node.state.prepare([ref]))
    other = DeviceState(
        driver_name="gpu.example.com",
        node_name="node-a",
        devices=node.state.devices,
        cdi_root=node.root / "cdi",
        data_dir=node.root / "plugin",
        claims=node.claims,
        health=Healthy(),
        reporter=NoReports(),
        real_devices=True,
        mig=node.backend.mig(),
        caps_root=node.root / "driver-root",
        proc_devices=node.state.context.proc_devices,
    )
    report = other.recover()
    assert report.rolled_back == () and report.problems == ()
    res = creating.join()["u"]
    assert res.ok, res.error
    (live,) = node.live()
    entry = Checkpoint(node.root / "plugin").load()["u"]
    assert entry.state is ClaimState.PREPARE_COMPLETED
    assert entry.devices[0].mig is not None and entry.devices[0].mig.uuid == live.uuid
    assert set(node.state.cdi.list_claim_specs()) == {"u"}


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_an_intent_is_rolled_back_only_once_no_live_process_holds_its_claim(
    tmp_path: Path,
) -> None:
    """A kill -9 after the create leaves the intent, the MIG device and the claim's
    lock file. While another process holds that lock (its request is in flight) a
    start leaves the entry alone; once it is gone, the start rolls it back."""
    root = _root(tmp_path, "node")
    _crash(root, "prepare", "prepare-after-mig-create")
    lock_file = root / "plugin" / f"inflight-{UID_A}.lock"
    assert lock_file.exists() and _live_mig(root) != set()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock_file)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        report = _state(root).recover()
        assert report.rolled_back == () and report.problems == ()
        entry = Checkpoint(root / "plugin").load()[UID_A]
        assert entry.state is ClaimState.PREPARE_STARTED and _live_mig(root) != set()
    finally:
        holder.kill()
        holder.wait()
    report = _state(root).recover()
    assert report.rolled_back == (UID_A,)
    assert Checkpoint(root / "plugin").load() == {} and _live_mig(root) == set()
    assert not lock_file.exists()
