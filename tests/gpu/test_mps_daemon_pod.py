"""gpu-dra-mps-daemon (driver/plugin/mps_daemon.py: the main process of an MPS
daemon's pod under Kubernetes, docs/mps.md) with the driver root's real
nvidia-cuda-mps-control, as the pod runs it but without a cluster: it writes the
startup-complete file only once the daemon holds the limits; a CUDA client of that
daemon (tests/gpu/cuda_alloc.py) is bounded by the pinned limit; SIGTERM (the
Deployment deleted) quits the daemon. The compute mode is read before and after and
must be unchanged; MIG mode is never touched."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import DaemonDirs, MpsControl
from tests.gpu.mps_gate import compute_mode, require_mps

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
LIMIT_MIB = 2048
REPO = Path(__file__).resolve().parents[2]


def _client(pipe: Path, uuid: str, mib: int) -> tuple[int, str]:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_VISIBLE_DEVICES": uuid,
           "PYTHONPATH": str(REPO)}  # fmt: skip
    argv = [sys.executable, "-m", "tests.gpu.cuda_alloc", str(mib)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    print(f"client alloc={mib}MiB: exit {proc.returncode} {proc.stdout.strip()!r}")
    return proc.returncode, proc.stdout


def test_the_pods_entrypoint_holds_the_limit_and_quits_on_sigterm(
    whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    mode = require_mps(ROOT, whole_gpu.uuid)
    dirs = DaemonDirs(tmp_path / "pipe", tmp_path / "log")
    ready = tmp_path / "run" / "startup-complete"
    argv = [
        sys.executable, "-m", "driver.plugin.mps_daemon", f"--driver-root={ROOT}",
        f"--pipe-directory={dirs.pipe}", f"--log-directory={dirs.log}",
        f"--gpu={whole_gpu.uuid}", f"--ready-file={ready}",
        "--active-thread-percentage=50", f"--pinned-memory-mib={LIMIT_MIB}",
    ]  # fmt: skip
    pod = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    control = MpsControl(ROOT)
    try:
        while not ready.exists():
            assert pod.poll() is None, f"gpu-dra-mps-daemon exited {pod.returncode}"
            time.sleep(0.05)
        assert control.command(dirs, "get_default_active_thread_percentage") in ("50", "50.0")
        status, out = _client(dirs.pipe, whole_gpu.uuid, 1)
        found = re.search(r"memory free=(\d+)", out)
        assert status == 0 and found, out
        free = int(found.group(1))
        assert 0 < free < LIMIT_MIB  # the daemon's limit, not the GPU's memory
        assert _client(dirs.pipe, whole_gpu.uuid, free - 64)[0] == 0
        assert _client(dirs.pipe, whole_gpu.uuid, free + 64)[0] == 3
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(timeout=60) == 0
        assert control.running(dirs) is None and not ready.exists()
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
        leftover = control.running(dirs)
        if leftover is not None:
            control.stop(dirs, leftover)
    assert compute_mode(whole_gpu.uuid) == mode
