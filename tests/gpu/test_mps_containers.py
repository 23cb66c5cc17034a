"""Two claims' MPS shares of one GPU, each with its own limits, used at once by two
containers, each started with exactly its own claim's CDI edits.

The claims are prepared through the plugin's path (tests/gpu/node.py) with
`--mps-daemons=node` (a control daemon per share, a process of the node, from the
driver root) and the driver's files from the driver root, as in test_cdi_container.py.
runc starts one container per claim over a root filesystem that holds this host's
Python and its C libraries, nothing of NVIDIA's (tests/gpu/containers.py), with the
claim's CDI devices applied as a CDI runtime does (tests/cdi_bundle.py); each runs the
CUDA client tests/gpu/cuda_bound.py, in lock-step with the test: both containers have
their CUDA context before either allocates, and both hold their allocation at once.

A container's bound is what its context reports free, measured in the same run (the
context's own memory, about 270 MiB, counts inside the pinned limit: docs/mps.md): it
must be under its own claim's limit, the two bounds apart by the difference of the
limits; 64 MiB over it fails with CUDA_ERROR_OUT_OF_MEMORY and 64 MiB under it succeeds.
Unprepare leaves no control daemon or MPS server of theirs and removes their
directories. The compute mode is read before and after (the driver never sets it);
MIG mode is never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from driver.cdi.device_nodes import CharMajors
from driver.cdi.driver_edits import DriverRoot
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import DaemonId, MpsControl
from driver.state.mps.daemons import NodeDaemons
from driver.state.request import ClaimRef
from tests import cdi_bundle
from tests.gpu import containers
from tests.gpu.bound_clients import Allocation
from tests.gpu.mps_containers import MARGIN_MIB, in_lockstep, mps_servers
from tests.gpu.mps_gate import SEVERAL_SERVERS, compute_mode, require_mps
from tests.gpu.mps_shares import MpsShare, left_running, prepare_shares
from tests.gpu.node import open_node

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
REPO = Path(__file__).resolve().parents[2]
SHARES = (MpsShare("mps-small", 2048, 25), MpsShare("mps-large", 4096, 50))
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


def _load_uvm(gpu_uuid: str) -> None:
    """CUDA in a container opens /dev/nvidia-uvm, which the claim's specs carry only
    once the nvidia-uvm module is loaded (docs/gpu-testing.md). CUDA on the host loads
    it on first use, as a node's driver set-up does at boot: one client, 1 MiB."""
    if CharMajors.read().uvm is not None:
        return
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": gpu_uuid}
    argv = [sys.executable, "-m", "tests.gpu.cuda_alloc", "1"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    print(f"a host CUDA client to load nvidia-uvm: exit {proc.returncode} {proc.stdout!r}")
    assert CharMajors.read().uvm is not None, "nvidia-uvm is not loaded after a host CUDA client"


def test_two_containers_are_each_bounded_by_their_own_claims_mps_limits(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path, monkeypatch: Any
) -> None:
    if not cdi_bundle.RUNC.is_file():
        pytest.skip(f"no runc at {cdi_bundle.RUNC} (make cluster-build; the tier bundle has it)")
    mode = require_mps(ROOT, whole_gpu.uuid, SEVERAL_SERVERS)
    control = MpsControl(ROOT)
    tools = containers.cdi_tools()
    monkeypatch.setenv("PATH", f"{tools}:{os.environ.get('PATH', '')}")
    driver = DriverRoot(ROOT, ROOT, str(tools / "nvidia-cdi-hook"))
    _load_uvm(whole_gpu.uuid)
    node = open_node(
        backend,
        tmp_path,
        driver_root=driver,
        mps_daemons=NodeDaemons(control),
        allow_multiple_allocations=True,
    )
    try:
        prepared = prepare_shares(node, f"gpu-{whole_gpu.minor}", SHARES)
        daemons = [DaemonId(p.record.pid, p.record.start_time) for p in prepared]
        run = in_lockstep(node, prepared, tmp_path, servers=mps_servers(control))
    finally:
        released = node.state.unprepare([ClaimRef("default", s.uid, s.uid) for s in SHARES])
    for report, free in zip(run.reports, run.bounds, strict=True):
        assert report.over == Allocation(free + MARGIN_MIB, CUDA_ERROR_OUT_OF_MEMORY)
        assert report.under == Allocation(free - MARGIN_MIB, CUDA_SUCCESS)
    small, large = run.bounds
    apart = SHARES[1].memory_mib - SHARES[0].memory_mib
    assert abs((large - small) - apart) <= MARGIN_MIB, (run.bounds, apart)
    assert released == {s.uid: None for s in SHARES}
    assert left_running(daemons + run.servers) == []
    assert not any(p.directory.exists() for p in prepared)
    assert compute_mode(whole_gpu.uuid) == mode
