"""Per-cgroup GPU memory limits on a real GPU whose driver has them (R615 and later;
docs/mps.md, "Memory limits the kernel driver keeps"): a hard limit set through the
backend reads back, holds a CUDA process of that cgroup (an allocation within it
succeeds, one past it fails with CUDA_ERROR_OUT_OF_MEMORY), is set on the cgroup a
process runs in by its pid, and clears. Needs root, cgroup v2 at /sys/fs/cgroup and a
GPU with MIG off; a driver without the calls skips the module with one line. The test
makes its own cgroup under the root and removes it; it changes no GPU setting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.cgroups import DEFAULT_CGROUP_ROOT
from driver.nvml.discovered import GpuInfo
from driver.nvml.memory_limits import GpuMemoryLimits, MemoryLimitError

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
CUDA_ERROR_OUT_OF_MEMORY = 2


@pytest.fixture
def limits(backend: NvmlBackend, whole_gpu: GpuInfo) -> GpuMemoryLimits:
    if os.geteuid() != 0:
        pytest.skip("per-cgroup memory limits: setting them needs root")
    if not (DEFAULT_CGROUP_ROOT / "cgroup.controllers").exists():
        pytest.skip(f"per-cgroup memory limits: no cgroup v2 at {DEFAULT_CGROUP_ROOT}")
    found = backend.memory_limits()
    why = found.probe(whole_gpu.uuid)
    if why is not None:
        pytest.skip(f"per-cgroup memory limits: {why}")
    return found


@pytest.fixture
def cgroup(limits: GpuMemoryLimits, whole_gpu: GpuInfo) -> Iterator[Path]:
    path = DEFAULT_CGROUP_ROOT / f"gpu-dra-test-{os.getpid()}"
    path.mkdir()
    try:
        controllers = (DEFAULT_CGROUP_ROOT / "cgroup.controllers").read_text().split()
        if "dmem" in controllers and not (path / "dmem.max").exists():
            pytest.skip(
                "per-cgroup memory limits: the kernel's dmem controller is not enabled for "
                f"the children of {DEFAULT_CGROUP_ROOT} (cgroup.subtree_control)"
            )
        yield path
    finally:
        try:
            limits.clear(whole_gpu.uuid, path)
        except MemoryLimitError as err:
            print(f"clearing the limits of {path}: {err}")
        for _ in range(50):  # its processes are gone once the kernel reaped them
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _in_cgroup(cgroup: Path, *argv: str, gpu: GpuInfo) -> subprocess.Popen[str]:
    def enter() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        list(argv), preexec_fn=enter, env=env, text=True, stdout=subprocess.PIPE, cwd=REPO
    )


def _alloc(cgroup: Path, mib: int, gpu: GpuInfo) -> tuple[int, str]:
    proc = _in_cgroup(cgroup, sys.executable, "-m", "tests.gpu.cuda_alloc", str(mib), gpu=gpu)
    out, _ = proc.communicate(timeout=120)
    print(f"{mib} MiB in {cgroup.name}: exit {proc.returncode}: {out.strip()}")
    return proc.returncode, out


def test_a_hard_limit_reads_back_and_holds_a_cuda_process(
    limits: GpuMemoryLimits, cgroup: Path, whole_gpu: GpuInfo
) -> None:
    seen = limits.set(whole_gpu.uuid, cgroup, hard_bytes=2 * GIB)
    assert (seen.soft_bytes, seen.hard_bytes) == (0, 2 * GIB)
    code, out = _alloc(cgroup, 512, whole_gpu)  # its context counts too: well within
    assert code == 0 and "allocated" in out
    total = int(out.split("total=")[1].split()[0])
    assert total <= 2048, f"cuMemGetInfo total {total} MiB: not capped to the hard limit"
    code, out = _alloc(cgroup, 4096, whole_gpu)
    assert code == 3 and f"failed {CUDA_ERROR_OUT_OF_MEMORY}" in out, out
    limits.clear(whole_gpu.uuid, cgroup)
    code, out = _alloc(cgroup, 4096, whole_gpu)  # cleared: the GPU's memory again
    assert code == 0 and "allocated" in out


def test_a_process_is_limited_in_the_cgroup_it_runs_in(
    limits: GpuMemoryLimits, cgroup: Path, whole_gpu: GpuInfo
) -> None:
    sleeper = _in_cgroup(cgroup, "sleep", "60", gpu=whole_gpu)
    try:
        for _ in range(50):
            if str(sleeper.pid) in (cgroup / "cgroup.procs").read_text().split():
                break
            time.sleep(0.1)
        seen = limits.limit_process(whole_gpu.uuid, sleeper.pid, GIB)
        assert Path(seen.cgroup) == cgroup and seen.hard_bytes == GIB
        assert limits.get(whole_gpu.uuid, cgroup).hard_bytes == GIB
    finally:
        sleeper.kill()
        sleeper.wait()
