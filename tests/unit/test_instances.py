"""The last plugin instance on a node is the one that cleans up node-wide files."""

from __future__ import annotations

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
print("last" if lock.release() else "not-last", flush=True)
"""


def test_single_instance_is_last(tmp_path: Path) -> None:
    assert InstanceLock(tmp_path).release() is True


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
    assert mine.release() is False  # the other instance still runs
    other.stdin.write("\n")
    other.stdin.flush()
    assert other.stdout.readline().strip() == "last"
    assert other.wait(10) == 0
