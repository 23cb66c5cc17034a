"""An MPS control daemon started by the driver's code for a claim's device
(driver/state/mps/claim_daemons.py, driver/nvml/mps.py) with the driver root's
nvidia-cuda-mps-control, and CUDA clients (tests/gpu/cuda_alloc.py) connected to it as
a container with the claim's CDI env would be: the pinned device-memory limit holds,
a client's own lower limit holds, a higher one does not lift the daemon's, two
clients run at once, and the daemon is gone afterwards. The GPU's compute mode is read
before and after and must be unchanged (the driver never sets it); MIG mode is never
touched."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import MpsControl
from driver.state.journal.checkpoint import PreparedDevice
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.claim_daemons import ClaimMps
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from tests.gpu.mps_gate import compute_mode, require_mps

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
LIMIT_MIB = 2048
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def daemon(whole_gpu: GpuInfo, tmp_path: Path) -> Iterator[tuple[ClaimMps, PreparedDevice]]:
    mode = require_mps(ROOT, whole_gpu.uuid)
    mps = ClaimMps(NodeDaemons(MpsControl(ROOT)), tmp_path / "mps")
    record = MpsRecord(whole_gpu.uuid, "claim-gpu-0", 50, LIMIT_MIB << 20)
    device = PreparedDevice("node", "gpu-0", ("r0",), ("k8s.x/gpu=claim-gpu-0",), mps=record)
    (started,) = mps.apply("gpu-tier", [device], {})
    try:
        yield mps, started
    finally:
        mps.restore("gpu-tier", [started], {})
        assert MpsControl(ROOT).running(daemon_dirs(mps.root, record)) is None
        assert compute_mode(whole_gpu.uuid) == mode


def _client(
    mps: ClaimMps, device: PreparedDevice, mib: int, limit: str | None = None, hold: bool = False
) -> subprocess.Popen[str]:
    assert device.mps is not None
    env = dict(os.environ)
    env.update(
        CUDA_MPS_PIPE_DIRECTORY=str(daemon_dirs(mps.root, device.mps).pipe),
        CUDA_VISIBLE_DEVICES=device.mps.gpu_uuid,
        PYTHONPATH=str(REPO),
    )
    if limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={limit}"
    argv = [sys.executable, "-m", "tests.gpu.cuda_alloc", str(mib), *(["--hold"] if hold else [])]
    # The client shares the daemon's /dev/shm (its device's shm directory) as a
    # container with the claim's CDI edits does: it enters the daemon's mount namespace.
    argv = ["nsenter", f"--mount=/proc/{device.mps.pid}/ns/mnt", "--", *argv]
    return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _allocates(mps: ClaimMps, device: PreparedDevice, mib: int, limit: str | None = None) -> bool:
    proc = _client(mps, device, mib, limit)
    out, _ = proc.communicate()
    print(f"client limit={limit} alloc={mib}MiB: {out.strip()!r}")
    assert proc.returncode in (0, 3), out
    return proc.returncode == 0


def _free_mib(mps: ClaimMps, device: PreparedDevice, limit: str | None = None) -> int:
    """What the client's context reports free (cuMemGetInfo) under MPS: its pinned
    limit less what the context itself holds (about 270 MiB on an H200, R580)."""
    proc = _client(mps, device, 1, limit)
    out, _ = proc.communicate()
    found = re.search(r"memory free=(\d+)", out)
    assert found and proc.returncode == 0, out
    return int(found.group(1))


def test_the_daemons_memory_limit_holds_for_each_client(
    daemon: tuple[ClaimMps, PreparedDevice],
) -> None:
    """Measured in the same run, not assumed: a context's own memory counts inside
    the limit, so each client's bound is what its context reports free."""
    mps, device = daemon
    free = _free_mib(mps, device)
    assert 0 < free < LIMIT_MIB  # the daemon's limit, not the GPU's 141 GiB
    assert _allocates(mps, device, free - 64)
    assert not _allocates(mps, device, free + 64)
    # A client's own lower limit holds; a higher one does not lift the daemon's.
    lower = _free_mib(mps, device, limit=f"{LIMIT_MIB // 2}M")
    assert 0 < lower < LIMIT_MIB // 2 and lower < free
    assert _allocates(mps, device, lower - 64, limit=f"{LIMIT_MIB // 2}M")
    assert not _allocates(mps, device, LIMIT_MIB // 2, limit=f"{LIMIT_MIB // 2}M")
    assert _free_mib(mps, device, limit=f"{LIMIT_MIB * 2}M") == free
    assert not _allocates(mps, device, free + 64, limit=f"{LIMIT_MIB * 2}M")


def test_two_clients_hold_their_memory_at_once(daemon: tuple[ClaimMps, PreparedDevice]) -> None:
    mps, device = daemon
    first = _client(mps, device, LIMIT_MIB // 2, hold=True)
    second = _client(mps, device, LIMIT_MIB // 2, limit="1536M", hold=True)
    try:
        for proc in (first, second):
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("memory free=")
            assert proc.stdout.readline().strip() == "allocated"
        assert device.mps is not None
        servers = MpsControl(ROOT).command(daemon_dirs(mps.root, device.mps), "get_server_list")
        print("MPS servers:", servers)
        assert servers.strip(), "the clients run without an MPS server"
    finally:
        for proc in (first, second):
            proc.communicate()
