"""The mock's per-cgroup memory limits answer as nvml.h (NVML 13.4) declares
`nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1`: FUNCTION_NOT_FOUND
before R615 (before any argument is looked at), NOT_SUPPORTED for a MIG device
handle, NO_PERMISSION for Set without root, INVALID_ARGUMENT for a soft limit above
the hard one or a limit above the device's memory, OPERATING_SYSTEM for a path that
cannot be opened, NOT_FOUND for a cgroup without limits; clearing with soft 0 and hard
MAX; a removed cgroup's limits gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from driver.nvml.mock import mock_memory_limits as mock_limits
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_api import NVMLError
from driver.nvml.mock.nvml import MockNvml

MAX = 0xFFFFFFFFFFFFFFFF
GIB = 1 << 30
H100_BYTES = 81559 << 20


def nvml(driver_version: str, **group: Any) -> MockNvml:
    fleet = parse_fleet(
        {
            "gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}, *group.values()],
            "driverVersion": driver_version,
        }
    )
    mock = MockNvml(fleet, "node-a")
    mock.nvmlInit()
    mock.privileged = True
    return mock


@pytest.fixture
def r615() -> Iterator[MockNvml]:
    yield nvml("615.71.09")


def set_limits(mock: MockNvml, handle: Any, path: Path | str, soft: int, hard: int) -> None:
    limits = mock.c_nvmlSetMemoryLimits_v1_t()
    limits.nameSpace = str(path).encode()
    limits.softLimit, limits.hardLimit = soft, hard
    mock.nvmlDeviceSetMemoryLimits_v1(handle, limits)


def get_limits(mock: MockNvml, handle: Any, path: Path | str) -> tuple[int, int, int]:
    limits = mock.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = str(path).encode()
    mock.nvmlDeviceGetMemoryLimits_v1(handle, limits)
    return limits.softLimit, limits.hardLimit, limits.currentUsed


def code(err: pytest.ExceptionInfo[NVMLError]) -> int:
    return err.value.value


def test_the_structs_have_the_fields_of_nvml_h_as_pynvml_binds_them() -> None:
    for name in ("c_nvmlSetMemoryLimits_v1_t", "c_nvmlGetMemoryLimits_v1_t"):
        assert getattr(mock_limits, name)._fields_ == getattr(pynvml, name)._fields_, name
    assert [f[0] for f in pynvml.c_nvmlGetMemoryLimits_v1_t._fields_] == [
        "nameSpace",
        "softLimit",
        "hardLimit",
        "currentUsed",
    ]
    assert mock_limits.NVML_DEVICE_MEMORY_LIMIT_MAX == pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX


@pytest.mark.parametrize("version", ["580.95.05", "610.10", "1.0.0"])
def test_a_driver_before_r615_has_no_such_function(version: str, tmp_path: Path) -> None:
    mock = nvml(version)
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(NVMLError) as err:
        set_limits(mock, handle, tmp_path, 0, GIB)
    assert code(err) == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    with pytest.raises(NVMLError) as err:  # before the arguments are looked at
        mock.nvmlDeviceGetMemoryLimits_v1(object(), None)
    assert code(err) == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND


def test_set_then_get_reads_the_limits_back(r615: MockNvml, tmp_path: Path) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(NVMLError) as err:  # none yet
        get_limits(r615, handle, tmp_path)
    assert code(err) == pynvml.NVML_ERROR_NOT_FOUND
    set_limits(r615, handle, tmp_path, GIB, 8 * GIB)
    assert get_limits(r615, handle, tmp_path) == (GIB, 8 * GIB, 0)
    assert get_limits(r615, handle, f"{tmp_path}/") == (GIB, 8 * GIB, 0)  # the same dir
    set_limits(r615, handle, tmp_path, 0, MAX)  # nvml.h's way to clear
    with pytest.raises(NVMLError) as err:
        get_limits(r615, handle, tmp_path)
    assert code(err) == pynvml.NVML_ERROR_NOT_FOUND


def test_limits_are_per_gpu(tmp_path: Path) -> None:
    mock = nvml("615.71.09", second={"model": "H100-80GB", "count": 1, "migMode": "disabled"})
    first, second = (mock.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    set_limits(mock, first, tmp_path, 0, 2 * GIB)
    with pytest.raises(NVMLError) as err:
        get_limits(mock, second, tmp_path)
    assert code(err) == pynvml.NVML_ERROR_NOT_FOUND
    assert mock.memory_limits_of(mock.gpus[0].uuid) == {str(tmp_path): (0, 2 * GIB)}


@pytest.mark.parametrize(
    ("soft", "hard"),
    [(2 * GIB, GIB), (0, H100_BYTES + 1), (H100_BYTES + 1, MAX)],
    ids=["soft-above-hard", "hard-above-memory", "soft-above-memory"],
)
def test_impossible_limits_are_invalid(
    r615: MockNvml, tmp_path: Path, soft: int, hard: int
) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(NVMLError) as err:
        set_limits(r615, handle, tmp_path, soft, hard)
    assert code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    set_limits(r615, handle, tmp_path, H100_BYTES, MAX)  # the whole memory, and "max"


def test_a_path_that_cannot_be_opened_is_an_operating_system_error(
    r615: MockNvml, tmp_path: Path
) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(NVMLError) as err:
            set_limits(r615, handle, path, 0, GIB)
        assert code(err) == pynvml.NVML_ERROR_OPERATING_SYSTEM
        with pytest.raises(NVMLError) as err:
            get_limits(r615, handle, path)
        assert code(err) == pynvml.NVML_ERROR_OPERATING_SYSTEM


def test_no_struct_is_an_invalid_argument(r615: MockNvml) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    for call in (r615.nvmlDeviceSetMemoryLimits_v1, r615.nvmlDeviceGetMemoryLimits_v1):
        with pytest.raises(NVMLError) as err:
            call(handle, None)
        assert code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_setting_needs_root_reading_does_not(r615: MockNvml, tmp_path: Path) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    set_limits(r615, handle, tmp_path, 0, GIB)
    r615.privileged = False
    with pytest.raises(NVMLError) as err:
        set_limits(r615, handle, tmp_path, 0, 2 * GIB)
    assert code(err) == pynvml.NVML_ERROR_NO_PERMISSION
    assert get_limits(r615, handle, tmp_path) == (0, GIB, 0)


def test_a_removed_cgroup_has_no_limits_even_when_made_again(
    r615: MockNvml, tmp_path: Path
) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    cgroup = tmp_path / "pod"
    cgroup.mkdir()
    set_limits(r615, handle, cgroup, 0, GIB)
    cgroup.rmdir()
    (tmp_path / "other").mkdir()  # the freed inode is not handed back at once
    cgroup.mkdir()
    with pytest.raises(NVMLError) as err:
        get_limits(r615, handle, cgroup)
    assert code(err) == pynvml.NVML_ERROR_NOT_FOUND


def test_mig_device_handles_are_not_supported(tmp_path: Path) -> None:
    mock = nvml("615.71.09", mig={"model": "H100-80GB", "count": 1, "migMode": "enabled"})
    gpu = mock.nvmlDeviceGetHandleByIndex(1)
    gi = mock.nvmlDeviceCreateGpuInstance(gpu, mock.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 0).id)
    mock.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig = mock.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    with pytest.raises(NVMLError) as err:
        set_limits(mock, mig, tmp_path, 0, GIB)
    assert code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
    set_limits(mock, gpu, tmp_path, 0, GIB)  # the GPU in MIG mode itself takes them


def test_a_lost_gpu_is_lost(r615: MockNvml, tmp_path: Path) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    r615.inject_gpu_lost(r615.gpus[0].uuid)
    with pytest.raises(NVMLError) as err:
        set_limits(r615, handle, tmp_path, 0, GIB)
    assert code(err) == pynvml.NVML_ERROR_GPU_IS_LOST


def test_current_used_counts_the_processes_of_the_cgroup(r615: MockNvml, tmp_path: Path) -> None:
    handle = r615.nvmlDeviceGetHandleByIndex(0)
    uid = "0f6b4ec1-2a8b-4a52-9d8e-5b6f3f0f6a11"
    pod = tmp_path / "kubepods.slice" / "kubepods-besteffort.slice"
    pod = pod / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    pod.mkdir(parents=True)
    r615.start_process(r615.gpus[0].uuid, used_bytes=3 * GIB, pod_uid=uid)
    r615.start_process(r615.gpus[0].uuid, used_bytes=GIB)  # no pod
    set_limits(r615, handle, pod, 0, 8 * GIB)
    assert get_limits(r615, handle, pod) == (0, 8 * GIB, 3 * GIB)
