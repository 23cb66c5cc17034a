"""The container side of tests/gpu/test_mps_containers.py without a GPU: two claims'
MPS shares of a mock GPU prepared as the tier prepares them (tests/gpu/mps_shares.py,
the mock's MPS stand-in as `--mps-daemons=node`), two runc containers started at once
with exactly their claim's CDI edits over this host's Python (tests/gpu/containers.py),
each running tests/gpu/cuda_bound.py in lock-step (tests/gpu/mps_containers.py), with a
stand-in libcuda (tests/fake_libcuda.c, built here with cc) that bounds a client by
the pinned limit its container's environment names. Each container must report its
own claim's bound: the CDI edits reached the right container, the root filesystem
runs Python with ctypes, the lock-step holds. What a real GPU answers is not shown
here. Needs runc (make cluster-build) and a C compiler; nothing skips."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from driver.nvml.mps import DaemonId
from tests.gpu.bound_clients import Allocation
from tests.gpu.mps_containers import MARGIN_MIB, in_lockstep, python_rootfs
from tests.gpu.mps_shares import (
    MpsShare,
    PreparedShare,
    left_running,
    mock_share_node,
    prepare_shares,
    unprepare_shares,
)
from tests.gpu.node import GpuNode

FAKE_LIBCUDA = Path(__file__).resolve().parents[1] / "fake_libcuda.c"
SHARES = (MpsShare("mps-small", 2048, 25), MpsShare("mps-large", 4096, 50))
CONTEXT_MIB = 271  # the stand-in's context, inside the limit


@pytest.fixture
def node(tmp_path: Path) -> GpuNode:
    return mock_share_node(tmp_path)[0]


@pytest.fixture
def libcuda(tmp_path: Path) -> Path:
    compiler = shutil.which("cc")
    assert compiler, "no C compiler (cc) to build tests/fake_libcuda.c"
    built = tmp_path / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(built), str(FAKE_LIBCUDA)], check=True)
    return built


def test_each_container_is_bounded_by_its_own_claims_limit_in_lockstep(
    node: GpuNode, libcuda: Path, tmp_path: Path
) -> None:
    def rootfs_with_libcuda(rootfs: Path, driver_libraries: Sequence[Path]) -> list[str]:
        assert driver_libraries == []  # the mock node mounts no driver
        argv = python_rootfs(rootfs, [libcuda])
        shutil.copy2(libcuda, rootfs / "lib" / "libcuda.so.1")
        return argv

    def daemon_as_server(share: PreparedShare) -> list[int]:
        return [share.record.pid]  # the stand-in daemon starts no MPS server

    prepared = prepare_shares(node, "gpu-0", SHARES)
    try:
        run = in_lockstep(
            node, prepared, tmp_path, servers=daemon_as_server, rootfs=rootfs_with_libcuda
        )
    finally:
        unprepare_shares(node, prepared)
    assert run.bounds == [s.memory_mib - CONTEXT_MIB for s in SHARES]
    for report, free in zip(run.reports, run.bounds, strict=True):
        assert report.over == Allocation(free + MARGIN_MIB, 2)
        assert report.under == Allocation(free - MARGIN_MIB, 0)
    daemons = [DaemonId(p.record.pid, p.record.start_time) for p in prepared]
    assert left_running(daemons) == []
    assert not any(p.directory.exists() for p in prepared)
