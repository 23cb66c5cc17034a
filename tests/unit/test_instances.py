"""The last plugin instance on a node is the one that cleans up node-wide files."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from driver.plugin.instances import InstanceLock

HOLD_IN_OTHER_PROCESS = """
import sys, time
from pathlib import Path
from driver.plugin.instances import InstanceLock
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
