"""The node lock covers what must be serialised, not the NVML calls that create and
destroy MIG devices (docs/state.md, "Locking").

On a real H100 a GPU-instance create or destroy takes hundreds of milliseconds to
seconds. Here the mock's create or destroy is held (`HeldCalls`) until the test
releases it, so each test shows the order of events instead of timing them, however
busy the machine: a prepare or unprepare that needs no NVML call finishes while one
is held, and every guarantee the lock gave stays: no double booking, no claim
prepared and torn down at the same time, no rollback of a prepare still in flight.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.state.journal.checkpoint import Checkpoint, ClaimState
from tests.unit.test_crash_safety import UID_A, _crash, _live_mig, _root, _state
from tests.unit.test_mig_prepare import Node, make_node, mig_state

# Seconds to wait for an event that, with the behaviour under test intact, comes at
# once: only a regression (or a deadlock) waits this long, and then the test fails.
EVENT_WAIT = 30.0
# gpu-0 and gpu-1 in dynamic MIG mode, gpu-2 a plain GPU.
FLEET = {
    "gpus": [
        {"model": "H100-80GB", "count": 2},
        {"model": "H100-80GB", "count": 1, "migMode": "disabled"},
    ]
}


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return make_node(tmp_path, FLEET)


class HeldCalls:
    """Every call of the mock's NVML function `name` waits, before it runs, until
    `release()`: a GPU-instance create or destroy in flight for as long as the test
    needs. `entered` counts the calls that reached it."""

    def __init__(self, node: Node, name: str) -> None:
        self.name = name
        self.entered = 0
        self._changed = threading.Condition()
        self._released = threading.Event()
        original = getattr(node.mock, name)

        def held(*args: Any, **kwargs: Any) -> Any:
            with self._changed:
                self.entered += 1
                self._changed.notify_all()
            self._released.wait(EVENT_WAIT)
            return original(*args, **kwargs)

        setattr(node.mock, name, held)

    def wait_entered(self, count: int) -> None:
        with self._changed:
            reached = self._changed.wait_for(lambda: self.entered >= count, EVENT_WAIT)
        assert reached, f"{self.name}: {count} call(s) in flight expected, {self.entered} came"

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def hold(node: Node) -> Iterator[Callable[[str], HeldCalls]]:
    """`hold(name)`: hold the mock's `name` calls; a failed test's are released at its end."""
    holds: list[HeldCalls] = []

    def _hold(name: str) -> HeldCalls:
        holds.append(HeldCalls(node, name))
        return holds[-1]

    yield _hold
    for held in holds:
        held.release()


def waits_for_a_claim_in_flight(node: Node) -> threading.Event:
    """Set once a prepare or unprepare of `node` waits for a claim another request
    has in flight (`ClaimLocks.wait_free`)."""
    waiting = threading.Event()
    wait_free = node.state.claim_locks.wait_free

    def noted(uids: Iterable[str], deadline: float) -> bool:
        waiting.set()
        return wait_free(uids, deadline)

    node.state.claim_locks.wait_free = noted  # type: ignore[method-assign]
    return waiting


class Background:
    """A call on another thread."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None

        def run() -> None:
            self.result = fn()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(timeout=EVENT_WAIT)
        assert not self.thread.is_alive()
        return self.result


CREATE = "nvmlDeviceCreateGpuInstanceWithPlacement"
DESTROY = "nvmlGpuInstanceDestroy"


def test_a_whole_gpu_prepare_does_not_wait_for_a_mig_create_in_flight(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    creates = hold(CREATE)
    mig = node.claims.add("mig", "gpu-0-mig-1g10gb-0")
    whole = node.claims.add("whole", "gpu-2")
    creating = Background(lambda: node.state.prepare([mig]))
    creates.wait_entered(1)

    res = node.state.prepare([whole])["whole"]  # the create is held all along

    assert res.ok, res.error
    creates.release()
    assert creating.join()["mig"].ok
    journal = Checkpoint(node.root / "plugin").load()
    assert {uid: e.state for uid, e in journal.items()} == {
        "mig": ClaimState.PREPARE_COMPLETED,
        "whole": ClaimState.PREPARE_COMPLETED,
    }
    assert set(node.state.cdi.list_claim_specs()) == {"mig", "whole"}


def test_a_whole_gpu_prepare_does_not_wait_for_a_mig_destroy_in_flight(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    mig = node.claims.add("mig", "gpu-0-mig-1g10gb-0")
    assert node.state.prepare([mig])["mig"].ok
    destroys = hold(DESTROY)
    whole = node.claims.add("whole", "gpu-2")
    destroying = Background(lambda: node.state.unprepare([mig]))
    destroys.wait_entered(1)

    res = node.state.prepare([whole])["whole"]  # the destroy is held all along

    assert res.ok, res.error
    destroys.release()
    assert destroying.join() == {"mig": None}
    assert node.live() == []
    assert set(Checkpoint(node.root / "plugin").load()) == {"whole"}


def test_mig_creates_on_two_gpus_run_side_by_side(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    creates = hold(CREATE)
    a = node.claims.add("a", "gpu-0-mig-1g10gb-0")
    b = node.claims.add("b", "gpu-1-mig-1g10gb-0")
    first = Background(lambda: node.state.prepare([a]))
    second = Background(lambda: node.state.prepare([b]))
    creates.wait_entered(2)  # both in NVML at once: neither waits for the other
    creates.release()
    assert first.join()["a"].ok
    assert second.join()["b"].ok


@pytest.mark.parametrize(
    "wanted", ["gpu-0-mig-1g10gb-0", "gpu-0-mig-2g20gb-0", "gpu-0"], ids=["same", "overlap", "gpu"]
)
def test_two_mig_prepares_for_one_placement_never_double_book(
    node: Node, hold: Callable[[str], HeldCalls], wanted: str
) -> None:
    """The second arrives while the first one's create is in flight: it waits for
    the first, then is refused."""
    creates = hold(CREATE)
    waiting = waits_for_a_claim_in_flight(node)
    first = node.claims.add("first", "gpu-0-mig-1g10gb-0")
    second = node.claims.add("second", wanted)
    creating = Background(lambda: node.state.prepare([first]))
    creates.wait_entered(1)
    refusing = Background(lambda: node.state.prepare([second]))
    assert waiting.wait(EVENT_WAIT), "the second prepare did not wait for the first"
    creates.release()
    assert creating.join()["first"].ok
    refused = refusing.join()["second"]
    assert refused.error is not None and not refused.error.permanent
    assert "first" in str(refused.error) and "overlaps" in str(refused.error)
    assert [m.placement for m in node.live()] == [(0, 1)]
    assert set(Checkpoint(node.root / "plugin").load()) == {"first"}
    assert set(node.state.cdi.list_claim_specs()) == {"first"}


def test_a_prepare_waits_for_the_unprepare_in_flight_that_frees_its_device(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    """The device is freed by an unprepare whose destroy is in flight: the new claim
    gets it once the destroy is done, not a refusal the kubelet must retry."""
    old = node.claims.add("old", "gpu-0-mig-1g10gb-0")
    assert node.state.prepare([old])["old"].ok
    destroys = hold(DESTROY)
    waiting = waits_for_a_claim_in_flight(node)
    new = node.claims.add("new", "gpu-0-mig-1g10gb-0")
    destroying = Background(lambda: node.state.unprepare([old]))
    destroys.wait_entered(1)
    preparing = Background(lambda: node.state.prepare([new]))
    assert waiting.wait(EVENT_WAIT), "the prepare did not wait for the unprepare in flight"
    destroys.release()
    assert destroying.join() == {"old": None}
    res = preparing.join()["new"]
    assert res.ok, res.error
    assert [m.placement for m in node.live()] == [(0, 1)]
    assert set(Checkpoint(node.root / "plugin").load()) == {"new"}


def test_an_unprepare_of_a_claim_whose_prepare_is_in_flight_waits_for_it(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    creates = hold(CREATE)
    waiting = waits_for_a_claim_in_flight(node)
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    creating = Background(lambda: node.state.prepare([ref]))
    creates.wait_entered(1)
    unpreparing = Background(lambda: node.state.unprepare([ref]))
    assert waiting.wait(EVENT_WAIT), "the unprepare did not wait for the prepare in flight"
    creates.release()
    assert creating.join()["u"].ok  # it was prepared, then unprepared
    assert unpreparing.join() == {"u": None}
    assert node.live() == []
    assert Checkpoint(node.root / "plugin").load() == {}
    assert set(node.state.cdi.list_claim_specs()) == set()


def test_the_wait_for_a_request_in_flight_is_bounded_by_the_lock_timeout(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    creates = hold(CREATE)
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    node.state.lock.timeout = 0.2
    creating = Background(lambda: node.state.prepare([ref]))
    creates.wait_entered(1)
    error = node.state.unprepare([ref])["u"]  # gives up while the create is held
    assert error is not None and not error.permanent
    assert "claim u is still in progress" in str(error)
    creates.release()
    assert creating.join()["u"].ok  # untouched by the unprepare that gave up
    assert Checkpoint(node.root / "plugin").load()["u"].state is ClaimState.PREPARE_COMPLETED


def test_a_repeated_prepare_of_a_claim_in_flight_answers_as_the_first(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    creates = hold(CREATE)
    waiting = waits_for_a_claim_in_flight(node)
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    creating = Background(lambda: node.state.prepare([ref]))
    creates.wait_entered(1)
    repeating = Background(lambda: node.state.prepare([ref]))
    assert waiting.wait(EVENT_WAIT), "the repeated prepare did not wait for the first"
    creates.release()
    first = creating.join()["u"]
    again = repeating.join()["u"]
    assert first.ok and again.ok, (first.error, again.error)
    assert again.devices == first.devices
    assert len(node.live()) == 1
    assert node.state.stats.rollbacks == 0


def test_a_starting_instance_leaves_a_prepare_in_flight_alone(
    node: Node, hold: Callable[[str], HeldCalls]
) -> None:
    """A rolling update: the new instance's start-up recovery runs while the old one
    creates a MIG device. Its `PrepareStarted` entry is not a crash's leftover."""
    creates = hold(CREATE)
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    creating = Background(lambda: node.state.prepare([ref]))
    creates.wait_entered(1)
    other = mig_state(node.root, node.backend, node.claims, node.state.devices)
    report = other.recover()  # the create is held all along
    assert report.rolled_back == () and report.problems == ()
    creates.release()
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
