"""Strict MPS on a real GPU with MIG off (docs/mps.md, "Strict: one MPS server,
EXCLUSIVE_PROCESS"): a whole-GPU MPS claim prepared by the driver's code, as the plugin
prepares it (tests/gpu/node.py, node MPS daemons of the driver root's
nvidia-cuda-mps-control), on a device that publishes `mpsIsolation: "strict"`:

- NVML reads the GPU's compute mode EXCLUSIVE_PROCESS while the claim is prepared;
- the claim's MPS client (tests/gpu/cuda_alloc.py in the daemon's mount namespace,
  as a container with the claim's CDI edits) creates its context and allocates;
- a CUDA process outside MPS (its CUDA_MPS_PIPE_DIRECTORY where no daemon listens)
  fails to create one while the client's server runs;
- unprepare puts back the mode NVML read before the prepare.

The mode found is put back whatever fails on the way (try/finally, through NVML);
MIG mode is never touched. Without a GPU the tier skips (tests/gpu/conftest.py);
without the driver root's nvidia-cuda-mps-control, or where no device of the GPU
publishes "strict", this test skips with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from driver.devices.model import MPS_ISOLATION_ATTRIBUTE, MPS_ISOLATION_STRICT
from driver.nvml.backend import NvmlBackend
from driver.nvml.compute_mode import COMPUTE_MODE_EXCLUSIVE_PROCESS, mode_name
from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import MpsControl, find_binary
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from tests.gpu.mps_shares import MpsShare
from tests.gpu.node import open_node

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
REPO = Path(__file__).resolve().parents[2]
LIMIT_MIB = 2048
THREADS = 50


def _cuda(uuid: str, pipe: Path, *, namespace_of: int | None, hold: bool) -> subprocess.Popen[str]:
    """tests/gpu/cuda_alloc.py allocating 64 MiB on the GPU, a client of the daemon
    whose pipe directory is `pipe` (entering its mount namespace, `namespace_of`: the
    daemon's pid) or, with no daemon there, a process outside MPS."""
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_VISIBLE_DEVICES": uuid,
        "PYTHONPATH": str(REPO),
    }
    argv = [sys.executable, "-m", "tests.gpu.cuda_alloc", "64", *(["--hold"] if hold else [])]
    if namespace_of is not None:
        argv = ["nsenter", f"--mount=/proc/{namespace_of}/ns/mnt", "--", *argv]
    return subprocess.Popen(
        argv,
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_strict_claim_holds_its_gpu_in_exclusive_process(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    uuid = whole_gpu.uuid
    if find_binary(ROOT) is None:
        pytest.skip(f"no nvidia-cuda-mps-control under the driver root {ROOT}")
    modes = backend.compute_modes()
    found = modes.get(uuid)
    node = open_node(backend, tmp_path, mps_daemons=NodeDaemons(MpsControl(ROOT)))
    strict = [
        d.name
        for d in node.pool.devices_of_gpu(uuid)
        if d.document["attributes"].get(MPS_ISOLATION_ATTRIBUTE) == {"string": MPS_ISOLATION_STRICT}
    ]
    if not strict:
        pytest.skip(f'no device of GPU {uuid} publishes mpsIsolation "strict" (before Volta?)')
    uid = "strict-gpu"
    ref = node.claims.add_configured(uid, strict[0], MpsShare(uid, LIMIT_MIB, THREADS).parameters())
    elsewhere = tmp_path / "elsewhere"  # no daemon listens there: CUDA runs without MPS
    elsewhere.mkdir()
    client: subprocess.Popen[str] | None = None
    unprepared: dict[str, object] = {}
    left = found
    try:
        result = node.state.prepare([ref])[uid]
        assert result.ok, result.error
        assert modes.get(uuid) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        (device,) = node.state.checkpoint.load()[uid].devices
        assert device.mps is not None and device.mps.compute_mode_before == found
        pipe = daemon_dirs(node.state.mps.root, device.mps).pipe
        client = _cuda(uuid, pipe, namespace_of=device.mps.pid, hold=True)
        assert client.stdout is not None
        said = [client.stdout.readline() for _ in range(2)]
        print(f"MPS client: {said!r}")
        assert said[-1].strip() == "allocated", said
        outside = _cuda(uuid, elsewhere, namespace_of=None, hold=False)
        out, _ = outside.communicate(timeout=120)
        print(f"outside MPS: exit {outside.returncode}: {out.strip()!r}")
        assert outside.returncode == 4 and "allocated" not in out, out  # no context
        client.communicate(timeout=120)  # stdin closed: it frees and exits
        assert client.returncode == 0
        client = None
    finally:
        if client is not None:
            client.kill()
            client.wait()
        unprepared = dict(node.state.unprepare([ref]))
        left = modes.get(uuid)
        if left != found:  # the mode found, whatever failed on the way
            modes.set(uuid, found)
    assert unprepared == {uid: None}
    assert left == found, f"unprepare left GPU {uuid} in {mode_name(left)}"
    assert modes.get(uuid) == found
