"""deployments/node-problem-detector/gpu-dra-check.sh against a status socket: what a
node-problem-detector custom plugin runs on the node, with curl only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from driver.observability.status_socket import StatusSocketServer

SCRIPT = Path(__file__).resolve().parents[2] / "deployments/node-problem-detector/gpu-dra-check.sh"


def check(socket: Path) -> tuple[int, str]:
    if shutil.which("curl") is None:
        pytest.fail("the check script needs curl, which the node-problem-detector image has")
    env = {**os.environ, "GPU_DRA_STATUS_SOCKET": str(socket)}
    done = subprocess.run([SCRIPT], env=env, capture_output=True, text=True, timeout=30)
    return done.returncode, done.stdout.strip()


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"healthy": True, "problems": []}, (0, "OK")),
        (
            {"healthy": False, "problems": ["gpu-1 (GPU-1) failed: Xid 79", "second"]},
            (1, "UNHEALTHY: gpu-1 (GPU-1) failed: Xid 79"),
        ),
    ],
)
def test_the_check_reads_the_status_socket(
    short_dir: Path, document: dict[str, Any], expected: tuple[int, str]
) -> None:
    path = short_dir / "status.sock"
    with StatusSocketServer(path, lambda: document, lambda: (True, "ok\n")).start():
        assert check(path) == expected


def test_no_plugin_is_a_problem(short_dir: Path) -> None:
    code, out = check(short_dir / "status.sock")
    assert code == 1 and out.startswith(f"UNHEALTHY: the plugin does not answer on {short_dir}")
