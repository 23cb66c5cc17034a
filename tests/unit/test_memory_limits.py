"""Per-cgroup GPU memory limits through the backend (`driver.nvml.memory_limits`) on the
mock: the feature detects itself (FUNCTION_NOT_FOUND before R615, NOT_SUPPORTED for a
MIG device), a limit is set and read back, a process's own cgroup is found from its
`/proc/<pid>/cgroup`; and the pod UID of a process's cgroup (`driver.nvml.cgroups`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.cgroups import cgroup_dir, pod_uid, process_cgroup, process_pod_uid
from driver.nvml.memory_limits import (
    NVML_DEVICE_MEMORY_LIMIT_MAX,
    MemoryLimitError,
    MemoryLimitsUnavailable,
)
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.nvml import MockNvml

GIB = 1 << 30
UID = "3c1a8f0e-93b4-4d6e-8f0a-2b7c9e1d4f55"
SYSTEMD = (
    "/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-abc123.scope"
)
CGROUPFS = f"/kubepods/besteffort/pod{UID}/0123456789abcdef"


def backend(
    driver_version: str, *, mig: bool = False, count: int = 1
) -> tuple[NvmlBackend, MockNvml]:
    groups = [{"model": "H100-80GB", "count": count, "migMode": "enabled" if mig else "disabled"}]
    mock = MockNvml(parse_fleet({"gpus": groups, "driverVersion": driver_version}), "node-a")
    mock.privileged = True
    return NvmlBackend(mock, backend_name="mock"), mock


def test_a_driver_before_r615_says_it_has_none(tmp_path: Path) -> None:
    nvml, mock = backend("580.95.05")
    limits = nvml.memory_limits()
    why = limits.probe(mock.gpus[0].uuid, tmp_path)
    assert why is not None and "R615" in why, why
    with pytest.raises(MemoryLimitsUnavailable) as err:
        limits.set(mock.gpus[0].uuid, tmp_path, hard_bytes=GIB)
    assert err.value.code == "NVML_ERROR_FUNCTION_NOT_FOUND"


def test_r615_has_them_and_a_limit_reads_back(tmp_path: Path) -> None:
    nvml, mock = backend("615.71.09")
    uuid = mock.gpus[0].uuid
    limits = nvml.memory_limits()
    assert limits.probe(uuid, tmp_path) is None  # NOT_FOUND there: no limit yet, but it works
    seen = limits.set(uuid, tmp_path, hard_bytes=8 * GIB)
    assert (seen.soft_bytes, seen.hard_bytes, seen.limited) == (0, 8 * GIB, True)
    assert limits.get(uuid, tmp_path) == seen
    limits.clear(uuid, tmp_path)
    with pytest.raises(MemoryLimitError) as err:
        limits.get(uuid, tmp_path)
    assert err.value.code == "NVML_ERROR_NOT_FOUND"
    assert mock.memory_limits_of(uuid) == {}


def test_nvml_refusals_name_their_code(tmp_path: Path) -> None:
    nvml, mock = backend("615.71.09")
    limits = nvml.memory_limits()
    with pytest.raises(MemoryLimitError) as err:
        limits.set(mock.gpus[0].uuid, tmp_path, soft_bytes=2 * GIB, hard_bytes=GIB)
    assert err.value.code == "NVML_ERROR_INVALID_ARGUMENT"
    with pytest.raises(MemoryLimitError) as err:
        limits.set(mock.gpus[0].uuid, tmp_path / "gone", hard_bytes=GIB)
    assert err.value.code == "NVML_ERROR_OPERATING_SYSTEM"
    mock.privileged = False
    with pytest.raises(MemoryLimitError) as err:
        limits.set(mock.gpus[0].uuid, tmp_path, hard_bytes=GIB)
    assert err.value.code == "NVML_ERROR_NO_PERMISSION"


def test_a_lost_gpu_leaves_the_other_gpus_limits_working(tmp_path: Path) -> None:
    """nvml.h: a lookup by UUID fails for every GPU while any one is lost; the limits
    of a healthy GPU are set all the same, and the lost one cannot tell."""
    nvml, mock = backend("615.71.09", count=2)
    healthy, lost = mock.gpus[0].uuid, mock.gpus[1].uuid
    limits = nvml.memory_limits()
    assert limits.probe(healthy, tmp_path) is None
    mock.inject_gpu_lost(lost)
    seen = limits.set(healthy, tmp_path, hard_bytes=4 * GIB)
    assert seen.hard_bytes == 4 * GIB
    why = limits.probe(lost, tmp_path)
    assert why is not None and "lost" in why.lower(), why
    with pytest.raises(MemoryLimitError) as err:
        limits.set(lost, tmp_path, hard_bytes=GIB)
    assert err.value.code == "NVML_ERROR_GPU_IS_LOST"


def test_a_mig_device_takes_none(tmp_path: Path) -> None:
    nvml, mock = backend("615.71.09", mig=True)
    gpu = mock.gpus[0].uuid
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    profile = mock.nvmlDeviceGetGpuInstanceProfileInfo(handle, 0).id
    mock.nvmlGpuInstanceCreateComputeInstance(mock.nvmlDeviceCreateGpuInstance(handle, profile), 0)
    mig_uuid = mock.nvmlDeviceGetUUID(mock.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    limits = nvml.memory_limits()
    why = limits.probe(mig_uuid, tmp_path)
    assert why is not None and "does not support" in why, why
    assert limits.probe(gpu, tmp_path) is None


def test_a_process_is_held_in_its_own_cgroup(tmp_path: Path) -> None:
    nvml, mock = backend("615.71.09")
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(f"0::{SYSTEMD}\n")
    leaf = cgroup_dir(cgroups, SYSTEMD)
    leaf.mkdir(parents=True)
    seen = nvml.memory_limits().limit_process(
        mock.gpus[0].uuid, 4242, 4 * GIB, proc_root=proc, cgroup_root=cgroups
    )
    assert seen.cgroup == str(leaf) and (seen.soft_bytes, seen.hard_bytes) == (0, 4 * GIB)
    assert mock.memory_limits_of(mock.gpus[0].uuid) == {str(leaf): (0, 4 * GIB)}
    with pytest.raises(MemoryLimitError, match="no cgroup v2 path"):
        nvml.memory_limits().limit_process(mock.gpus[0].uuid, 4243, GIB, proc_root=proc)


def test_the_max_sentinel_is_nvml_h_s() -> None:
    assert NVML_DEVICE_MEMORY_LIMIT_MAX == 2**64 - 1


@pytest.mark.parametrize("path", [SYSTEMD, CGROUPFS, f"{SYSTEMD}/init"])
def test_the_pod_uid_of_a_cgroup_path(path: str) -> None:
    assert pod_uid(path) == UID


@pytest.mark.parametrize("path", ["/", "/system.slice/containerd.service", "/user.slice"])
def test_a_cgroup_of_no_pod(path: str) -> None:
    assert pod_uid(path) is None


def test_a_process_s_cgroup_and_pod(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(f"12:memory:{CGROUPFS}\n1:name=systemd:{CGROUPFS}\n")
    assert process_cgroup(tmp_path, 7) is None  # cgroup v1 only
    assert process_pod_uid(tmp_path, 7) == UID
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cgroup").write_text(f"0::{SYSTEMD}\n")
    assert process_cgroup(tmp_path, 8) == SYSTEMD and process_pod_uid(tmp_path, 8) == UID
    assert process_cgroup(tmp_path, 9) is None and process_pod_uid(tmp_path, 9) is None


def test_the_backend_calls_only_pynvml_s_api_with_its_signatures(tmp_path: Path) -> None:
    """As tests/unit/test_pynvml_contract.py does for discovery and events: the memory
    limits and the process listing use names pynvml has, called as pynvml binds them."""
    import inspect

    import pynvml

    from tests.unit.test_pynvml_contract import Recorder

    _, mock = backend("615.71.09")
    recorder = Recorder(mock)
    nvml = NvmlBackend(recorder, backend_name="mock")
    uuid = mock.gpus[0].uuid
    mock.start_process(uuid, "mps-client")
    mock.start_process(uuid)
    assert len(nvml.gpu_processes(uuid).processes) == 3
    limits = nvml.memory_limits()
    assert limits.probe(uuid, tmp_path) is None
    limits.set(uuid, tmp_path, hard_bytes=GIB)
    limits.clear(uuid, tmp_path)
    called = {name for name, _, _ in recorder.calls}
    assert {
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses",
        "nvmlSystemGetProcessName",
        "nvmlDeviceSetMemoryLimits_v1",
        "nvmlDeviceGetMemoryLimits_v1",
    } <= called
    missing = sorted(a for a in recorder.attributes if not hasattr(pynvml, a))
    assert not missing, missing
    for name, args, kwargs in recorder.calls:
        inspect.signature(getattr(pynvml, name)).bind(*args, **kwargs)


def test_a_cgroup_the_driver_refuses_still_shows_the_call_is_there(tmp_path: Path) -> None:
    nvml, mock = backend("615.71.09")
    limits = nvml.memory_limits()
    assert limits.probe(mock.gpus[0].uuid, tmp_path / "no-such-cgroup") is None
    mock.inject_gpu_lost(mock.gpus[0].uuid)
    why = limits.probe(mock.gpus[0].uuid, tmp_path)
    assert why is not None and "lost" in why.lower(), why
