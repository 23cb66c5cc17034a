"""Every `gpu-dra` command that reads the plugin's data directory, run by a user who may
not read it (a debug container without root): one line naming the file and what to
do, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

GPU_DRA = Path(sys.executable).parent / "gpu-dra"
NOBODY = 65534

COMMANDS = [
    ["journal", "show"],
    ["journal", "quarantine", "--yes"],
    ["health"],
    ["health", "clear", "gpu-0", "--yes"],
    ["status"],
    ["mock", "xid", "--device", "gpu-0", "--xid", "79"],
]


@pytest.fixture
def root_only_state_dir() -> Iterator[Path]:
    """A plugin data directory as the plugin leaves it: mode 0700, its files inside,
    under a directory anyone may traverse."""
    parent = Path(tempfile.mkdtemp(prefix="gdra-perm-", dir="/tmp"))
    parent.chmod(0o755)
    state_dir = parent / "gpu.example.com"
    state_dir.mkdir(mode=0o700)
    (state_dir / "checkpoint.json").write_text("{}")
    (state_dir / "health.json").write_text("{}")
    if os.geteuid() != 0:
        state_dir.chmod(0o000)  # its owner cannot read it either
    yield state_dir
    state_dir.chmod(0o700)
    shutil.rmtree(parent)


def as_unprivileged(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("running as root without setpriv (util-linux): cannot drop privileges")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_permission_denied_is_one_line_with_what_to_do(
    command: list[str], root_only_state_dir: Path
) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/tmp",
        "GPU_DRA_STATE_DIR": str(root_only_state_dir),
    }
    done = subprocess.run(
        as_unprivileged([str(GPU_DRA), *command]),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    advice = [line for line in output.splitlines() if "run as root" in line]
    assert advice, output
    assert str(root_only_state_dir) in advice[0] and "docs/day-2.md" in advice[0], output
    if command[0] != "status":  # status lists every problem and exits 0 by default
        assert done.returncode == 1, output
