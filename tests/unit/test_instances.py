"""The plugin instances of one node: the last one cleans up node-wide files; the newest
one the kubelet registered serves the node, and the next one when it exits."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from driver.plugin.serving_instance import InstanceLock, Place, Succession

HOLD_IN_OTHER_PROCESS = """
import sys, time
from pathlib import Path
from driver.plugin.serving_instance import InstanceLock
lock = InstanceLock(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.readline()
print("last" if lock.release(lambda: None) else "not-last", flush=True)
"""


def test_single_instance_is_last(tmp_path: Path) -> None:
    assert InstanceLock(tmp_path).release(lambda: None) is True


def test_overlapping_instances_only_the_later_leaver_is_last(tmp_path: Path) -> None:
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD_IN_OTHER_PROCESS, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout is not None and other.stdin is not None
    assert other.stdout.readline().strip() == "held"
    mine = InstanceLock(tmp_path)
    ran: list[str] = []
    assert mine.release(lambda: ran.append("cleanup")) is False  # the other still runs
    assert ran == []
    other.stdin.write("\n")
    other.stdin.flush()
    assert other.stdout.readline().strip() == "last"
    assert other.wait(10) == 0


def test_last_instance_cleans_up_while_holding_the_lock(tmp_path: Path) -> None:
    """A successor starting during the cleanup must wait for it (its InstanceLock
    blocks), or the leaver would remove the common spec the successor just wrote."""
    seen: list[bool] = []

    def cleanup() -> None:
        fd = os.open(tmp_path / "instances.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            seen.append(False)  # a successor could have started
        except BlockingIOError:
            seen.append(True)
        finally:
            os.close(fd)

    assert InstanceLock(tmp_path).release(cleanup) is True
    assert seen == [True]


# --- which instance serves the node (Succession) ---------------------------------------

HOLD_A_PLACE = """
import sys
from pathlib import Path
from driver.plugin.serving_instance import Succession
s = Succession(Path(sys.argv[1]), holder="crashing pod")
s.registered()
print(s.place.number, flush=True)
sys.stdin.readline()
"""


def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def instances(tmp_path: Path) -> Iterator[list[Succession]]:
    made: list[Succession] = []
    yield made
    for s in made:
        s.stop()


def instance(made: list[Succession], data_dir: Path, holder: str) -> Succession:
    s = Succession(data_dir, holder=holder)
    made.append(s)
    return s


def test_an_instance_alone_serves_from_its_start(tmp_path: Path, instances: list) -> None:
    only = instance(instances, tmp_path, "only")
    assert only.start() is True
    assert only.serving() and only.newer() is None


def test_a_new_instance_serves_only_once_the_kubelet_registered_it(
    tmp_path: Path, instances: list
) -> None:
    old, new = instance(instances, tmp_path, "old"), instance(instances, tmp_path, "new")
    changes: list[bool] = []
    old.on_change(changes.append)
    assert old.start() is True
    old.watch()
    # Started beside a serving instance: it waits (a stalled rollout stays here).
    assert new.start() is False
    assert not new.serving() and new.newer() == old.place
    assert old.serving()
    new.registered()
    assert new.serving() and new.newer() is None
    assert not old.serving() and old.newer() == new.place
    until(lambda: changes == [True, False], "the old instance to notice it yielded")


def test_the_older_instance_serves_again_when_the_newer_one_exits(
    tmp_path: Path, instances: list
) -> None:
    old, new = instance(instances, tmp_path, "old"), instance(instances, tmp_path, "new")
    changes: list[bool] = []
    old.on_change(changes.append)
    old.start()
    old.watch()
    new.start()
    new.registered()
    until(lambda: changes == [True, False], "the old instance to yield")
    new.stop()  # a rollback removed the new pod
    until(lambda: changes == [True, False, True], "the old instance to serve again")
    assert old.serving()


def test_a_crashed_newer_instance_hands_the_node_back(tmp_path: Path, instances: list) -> None:
    old = instance(instances, tmp_path, "old")
    old.start()
    crashing = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_PLACE, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert crashing.stdout is not None
    number = int(crashing.stdout.readline())
    assert old.newer() == Place(number, "crashing pod")
    crashing.kill()  # SIGKILL: no clean-up, the kernel drops the lock
    crashing.wait(10)
    assert old.serving()
    # The next place is above the dead one, whose file goes when a place is taken.
    new = instance(instances, tmp_path, "new")
    new.registered()
    assert new.place is not None and new.place.number == number + 1
    assert not (tmp_path / "succession" / f"{number:012d}").exists()


def test_an_instance_left_alone_before_its_registration_takes_the_node(
    tmp_path: Path, instances: list
) -> None:
    old, new = instance(instances, tmp_path, "old"), instance(instances, tmp_path, "new")
    changes: list[bool] = []
    new.on_change(changes.append)
    old.start()
    assert new.start() is False
    new.watch()
    old.stop()
    until(lambda: changes == [True], "the waiting instance to serve")
    assert new.serving()


def test_two_instances_starting_at_once_never_both_serve(tmp_path: Path) -> None:
    for _ in range(20):
        data_dir = tmp_path / str(_)
        data_dir.mkdir()
        pair = [Succession(data_dir, holder=str(i)) for i in range(2)]
        barrier = threading.Barrier(2)

        def start(s: Succession, out: list[bool], barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            out.append(s.start())

        results: list[bool] = []
        threads = [threading.Thread(target=start, args=(s, results)) for s in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, True]
        assert [s.serving() for s in pair].count(True) == 1
        for s in pair:
            s.stop()


def test_a_fifo_or_symlink_planted_as_a_place_is_no_instance(tmp_path: Path) -> None:
    """Never followed, never blocked on: a planted FIFO would hang every prepare."""
    succession = tmp_path / "succession"
    succession.mkdir()
    os.mkfifo(succession / f"{99:012d}")
    (succession / f"{98:012d}").symlink_to(tmp_path / "elsewhere")
    only = Succession(tmp_path, holder="only")
    try:
        assert only.start() is True
        assert only.serving() and only.newer() is None
    finally:
        only.stop()


def test_an_instance_never_yields_to_its_own_new_place(tmp_path: Path) -> None:
    """While the kubelet's registration moves this instance to a new place, the new
    place file is there, locked by this very process, before the instance records it:
    a prepare asking `newer()` in that window must not be told to yield to itself."""
    mine = Succession(tmp_path, holder="node pid 7")
    assert mine.start()
    real_rename = os.rename
    seen: list[object] = []

    def rename_then_ask(src: object, dst: object) -> None:
        real_rename(src, dst)  # the new place file is there and locked ...
        seen.append(mine.newer())  # ... and a prepare asks before `_place` names it

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", rename_then_ask)
        mine.registered()
    try:
        assert seen == [None]
        place = mine.place
        assert place is not None and place.number == 2 and mine.serving()
    finally:
        mine.stop()
