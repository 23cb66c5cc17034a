"""gpu-dra-mps-daemon, the main process of an MPS daemon's pod (driver/plugin/
mps_daemon.py), on the mock driver root's stand-in nvidia-cuda-mps-control: it
starts the daemon with the limits, writes the startup-complete file only once the
daemon holds them, quits the daemon on SIGTERM, and ends with status 1 when the
daemon dies (the kubelet restarts the container)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.mock.mps_control import install_mps_control
from driver.nvml.mps import DaemonDirs, MpsControl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], MpsControl, DaemonDirs, Path]]:
    root = tmp_path / "root"
    install_mps_control(root)
    dirs = DaemonDirs(tmp_path / "pipe", tmp_path / "log")
    ready = tmp_path / "run" / "startup-complete"
    argv = [
        sys.executable, "-m", "driver.plugin.mps_daemon",
        f"--driver-root={root}", f"--pipe-directory={dirs.pipe}",
        f"--log-directory={dirs.log}", "--gpu=GPU-1234", f"--ready-file={ready}",
        "--active-thread-percentage=40", "--pinned-memory-mib=1024",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    control = MpsControl(root)
    try:
        yield proc, control, dirs, ready
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        daemon = control.running(dirs)
        if daemon is not None:
            os.kill(daemon.pid, signal.SIGKILL)


def _wait_ready(proc: subprocess.Popen[str], ready: Path) -> None:
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)


def test_ready_only_once_the_daemon_holds_the_limits_and_sigterm_quits_it(
    pod: tuple[subprocess.Popen[str], MpsControl, DaemonDirs, Path],
) -> None:
    proc, control, dirs, ready = pod
    _wait_ready(proc, ready)
    daemon = control.running(dirs)
    assert daemon is not None and ready.read_text() == f"{daemon.pid}\n"
    assert control.command(dirs, "get_default_active_thread_percentage") == "40.0"
    assert control.command(dirs, "get_default_device_pinned_mem_limit 0") == "1024M"
    told = (dirs.log / "control.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=GPU-1234" in told
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 0
    assert control.running(dirs) is None and not ready.exists()


def test_a_daemon_that_dies_ends_the_pod_process_with_status_1(
    pod: tuple[subprocess.Popen[str], MpsControl, DaemonDirs, Path],
) -> None:
    proc, control, dirs, ready = pod
    _wait_ready(proc, ready)
    daemon = control.running(dirs)
    assert daemon is not None
    os.kill(daemon.pid, signal.SIGKILL)
    assert proc.wait() == 1
    assert (
        proc.stderr is not None
        and f"the MPS control daemon {daemon.pid} is gone" in proc.stderr.read()
    )
    assert not ready.exists()
