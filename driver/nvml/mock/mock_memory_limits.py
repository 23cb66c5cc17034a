"""The mock NVML's per-cgroup memory limits: `nvmlDeviceSetMemoryLimits_v1` and
`nvmlDeviceGetMemoryLimits_v1`, exactly as nvml.h (NVML 13.4) declares them.

`MemoryLimitFunctions` is mixed into `MockNvml`. As pynvml binds them, both take a
device handle and the struct (`c_nvmlSetMemoryLimits_v1_t`: `nameSpace`, `softLimit`,
`hardLimit`; `c_nvmlGetMemoryLimits_v1_t`: the same and `currentUsed`; pynvml passes
it by reference) and return nothing. What they answer, in order:

- FUNCTION_NOT_FOUND where the fleet's driver is before R615 (NVML's change log adds
  them between v610 and v615): an older libnvidia-ml has no such symbol, and pynvml
  says so before any argument is looked at. The default fleet (580.95.05) has none;
  `driverVersion: "615.71.09"` in a fleet file has them;
- INVALID_ARGUMENT for no struct or an invalid handle, GPU_IS_LOST for a lost GPU,
  NOT_SUPPORTED for a MIG device handle ("MIG handles are not supported");
- Set only: NO_PERMISSION unless the caller is root ("Requires root/admin
  permissions"; `privileged`, the process's effective uid by default);
  INVALID_ARGUMENT when the soft limit exceeds the hard one or a limit exceeds the
  device's memory (`NVML_DEVICE_MEMORY_LIMIT_MAX` is "max", not a size);
- OPERATING_SYSTEM where `nameSpace` is not a directory that can be opened ("if the
  cgroup path cannot be opened");
- Get only: NOT_FOUND where the cgroup has no limits on the device.

Soft 0 and hard MAX clears a cgroup's limits. Limits belong to the cgroup, not to its
path: a directory removed and made again (another inode) has none ("Removing the
cgroup will also clear any limits"). `currentUsed` is what the mock processes in that
cgroup or below it use on the device. The limits are kept in the mock's memory (the
plugin's process); the kernel keeps real ones while their cgroup exists.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from driver.nvml.mock.fleet import Fleet, MockGpu
from driver.nvml.mock.mock_api import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_OPERATING_SYSTEM,
    NVMLError,
    nvml_call,
    ref_target,
)

NVML_DEVICE_MEMORY_LIMIT_MAX: Final = 0xFFFFFFFFFFFFFFFF
FIRST_DRIVER_BRANCH: Final = 615


class c_nvmlSetMemoryLimits_v1_t(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


class c_nvmlGetMemoryLimits_v1_t(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
        ("currentUsed", ctypes.c_ulonglong),
    ]


def has_memory_limits(driver_version: str) -> bool:
    """Whether a driver of this version has nvmlDeviceSetMemoryLimits_v1 (R615 on)."""
    major = driver_version.split(".")[0]
    return major.isascii() and major.isdigit() and int(major) >= FIRST_DRIVER_BRANCH


def _cgroup(limits: Any) -> tuple[str, int]:
    """The directory `nameSpace` names and its inode; OPERATING_SYSTEM where it cannot
    be opened as one."""
    raw = limits.nameSpace
    if not raw:
        raise NVMLError(NVML_ERROR_OPERATING_SYSTEM)
    path = os.path.normpath(raw.decode() if isinstance(raw, bytes) else str(raw))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        raise NVMLError(NVML_ERROR_OPERATING_SYSTEM) from None
    try:
        return path, os.fstat(fd).st_ino
    finally:
        os.close(fd)


class MemoryLimitFunctions:
    """The memory-limit part of `MockNvml`."""

    _lock: threading.RLock
    fleet: Fleet
    c_nvmlSetMemoryLimits_v1_t = c_nvmlSetMemoryLimits_v1_t
    c_nvmlGetMemoryLimits_v1_t = c_nvmlGetMemoryLimits_v1_t

    if TYPE_CHECKING:

        def _not_mig(self, handle: Any) -> MockGpu: ...

        def mock_gpu(self, uuid: str) -> MockGpu: ...

        def _cgroup_used(self, gpu_index: int, cgroup: str) -> int: ...

    def _init_memory_limits(self) -> None:
        # (GPU index, cgroup directory) -> (its inode, soft, hard)
        self._memory_limits: dict[tuple[int, str], tuple[int, int, int]] = {}
        self.privileged = os.geteuid() == 0

    def _limits_target(self, device: Any, limits: Any) -> tuple[MockGpu, Any]:
        if not has_memory_limits(self.fleet.resolved_driver_version):
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        target = None if limits is None else ref_target(limits)
        if target is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._not_mig(device), target

    @nvml_call
    def nvmlDeviceSetMemoryLimits_v1(self, device: Any, limits: Any) -> None:
        gpu, target = self._limits_target(device, limits)
        if not self.privileged:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        soft, hard = int(target.softLimit), int(target.hardLimit)
        total = gpu.profile.memoryMiB << 20
        if soft > hard or any(v > total for v in (soft, hard) if v != NVML_DEVICE_MEMORY_LIMIT_MAX):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        path, inode = _cgroup(target)
        with self._lock:
            if soft == 0 and hard == NVML_DEVICE_MEMORY_LIMIT_MAX:
                self._memory_limits.pop((gpu.index, path), None)
            else:
                self._memory_limits[gpu.index, path] = (inode, soft, hard)

    @nvml_call
    def nvmlDeviceGetMemoryLimits_v1(self, device: Any, limits: Any) -> None:
        gpu, target = self._limits_target(device, limits)
        path, inode = _cgroup(target)
        with self._lock:
            kept = self._memory_limits.get((gpu.index, path))
            if kept is not None and kept[0] != inode:  # the cgroup was removed meanwhile
                del self._memory_limits[gpu.index, path]
                kept = None
        if kept is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        target.softLimit, target.hardLimit = kept[1], kept[2]
        target.currentUsed = self._cgroup_used(gpu.index, path)

    def memory_limits_of(self, gpu_uuid: str) -> dict[str, tuple[int, int]]:
        """Cgroup directory -> (soft, hard) set on the GPU, for tests."""
        index = self.mock_gpu(gpu_uuid).index
        with self._lock:
            return {
                path: (soft, hard)
                for (i, path), (_, soft, hard) in self._memory_limits.items()
                if i == index and Path(path).is_dir()
            }
