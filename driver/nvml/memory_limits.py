"""GPU memory limits per cgroup, kept by the NVIDIA kernel driver (NVML R615 and later).

nvml.h (NVML 13.4, "Changes between NVML v610 and v615" in NVML's change log) declares

    nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t, nvmlSetMemoryLimits_v1_t *);
    nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *);

with `nvmlSetMemoryLimits_v1_t {const char *nameSpace; unsigned long long softLimit,
hardLimit;}` and `nvmlGetMemoryLimits_v1_t` the same plus `currentUsed`: `nameSpace` is
the full path of a cgroup (v2) directory, the limits are bytes. The hard limit is the
most the cgroup's processes may allocate on the device (an allocation past it fails,
CUDA_ERROR_OUT_OF_MEMORY); the soft limit is what it is guaranteed before allocations
may fail under memory pressure. Soft 0 and hard `NVML_DEVICE_MEMORY_LIMIT_MAX` is "no
limit" (and clears one); removing the cgroup clears its limits. Setting needs root,
reading does not; MIG device handles are not supported; a limit above the device's
memory or a soft limit above the hard one is INVALID_ARGUMENT, a path that cannot be
opened OPERATING_SYSTEM, a cgroup without limits NOT_FOUND (on Get).

nvidia-ml-py binds both (`pynvml.nvmlDeviceSetMemoryLimits_v1(device, limits)`, its
structs `c_nvmlSetMemoryLimits_v1_t` / `c_nvmlGetMemoryLimits_v1_t`); an older
libnvidia-ml has no such symbol, which pynvml answers with
NVML_ERROR_FUNCTION_NOT_FOUND: that is how the feature detects itself
(`GpuMemoryLimits.probe`). Where the driver sets a claim's limit, and why there:
docs/mps.md, "Memory limits the kernel driver keeps".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.nvml.calls import CountingModule, is_nvml_error
from driver.nvml.cgroups import DEFAULT_CGROUP_ROOT, DEFAULT_PROC_ROOT, cgroup_dir, process_cgroup
from driver.nvml.library import GpuHandles

log = logging.getLogger(__name__)

NVML_DEVICE_MEMORY_LIMIT_MAX: Final = 0xFFFFFFFFFFFFFFFF

_UNAVAILABLE = ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED")
_ERROR_NAMES = (
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_OPERATING_SYSTEM",
    "NVML_ERROR_UNKNOWN",
)


class MemoryLimitError(Exception):
    """NVML refused a memory-limit call; `code` names NVML's return code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class MemoryLimitsUnavailable(MemoryLimitError):
    """The driver has no per-cgroup memory limits (FUNCTION_NOT_FOUND: before R615),
    or the device does not support them (NOT_SUPPORTED; a MIG device handle)."""


@dataclass(frozen=True)
class CgroupMemoryLimits:
    """A cgroup's limits on one GPU as NVML reads them back (bytes)."""

    cgroup: str  # the directory NVML was given
    soft_bytes: int
    hard_bytes: int  # NVML_DEVICE_MEMORY_LIMIT_MAX: no hard limit
    used_bytes: int

    @property
    def limited(self) -> bool:
        return self.hard_bytes != NVML_DEVICE_MEMORY_LIMIT_MAX


class GpuMemoryLimits:
    """`nvmlDeviceSetMemoryLimits_v1` / `GetMemoryLimits_v1` on GPUs named by UUID,
    found by index (`GpuHandles`): while one GPU is lost, the others keep their limits."""

    def __init__(self, nvml: CountingModule | Any, gpus: GpuHandles | None = None) -> None:
        self._nvml = nvml
        self._gpus = gpus or GpuHandles(nvml)

    def probe(self, gpu_uuid: str, cgroup_root: Path | str = DEFAULT_CGROUP_ROOT) -> str | None:
        """None where the GPU takes per-cgroup memory limits; else why not. Reads the
        limits of `cgroup_root` (a read needs no privilege and changes nothing): only
        FUNCTION_NOT_FOUND (a driver before R615) and NOT_SUPPORTED say "no", and a GPU
        that does not answer (lost, NVML not initialised) cannot tell; any other
        answer (none there: NOT_FOUND; that cgroup refused) comes from a driver that
        has the call."""
        try:
            self.get(gpu_uuid, cgroup_root)
        except MemoryLimitsUnavailable as err:
            return str(err)
        except MemoryLimitError as err:
            if err.code in ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNINITIALIZED"):
                return str(err)
            log.debug("GPU %s has per-cgroup memory limits (%s)", gpu_uuid, err)
        return None

    def get(self, gpu_uuid: str, cgroup: Path | str) -> CgroupMemoryLimits:
        """The cgroup's limits on the GPU; MemoryLimitError NVML_ERROR_NOT_FOUND where
        none were set."""
        limits = self._nvml.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = str(cgroup).encode()
        self._call("nvmlDeviceGetMemoryLimits_v1", gpu_uuid, cgroup, limits)
        return CgroupMemoryLimits(
            str(cgroup), int(limits.softLimit), int(limits.hardLimit), int(limits.currentUsed)
        )

    def set(
        self, gpu_uuid: str, cgroup: Path | str, *, hard_bytes: int, soft_bytes: int = 0
    ) -> CgroupMemoryLimits:
        """Set the cgroup's limits on the GPU and read them back; MemoryLimitError when
        NVML refuses, or reads back other limits than it was given."""
        limits = self._nvml.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = str(cgroup).encode()
        limits.softLimit = soft_bytes
        limits.hardLimit = hard_bytes
        self._call("nvmlDeviceSetMemoryLimits_v1", gpu_uuid, cgroup, limits)
        cleared = soft_bytes == 0 and hard_bytes == NVML_DEVICE_MEMORY_LIMIT_MAX
        try:
            seen = self.get(gpu_uuid, cgroup)
        except MemoryLimitError as err:
            if cleared and err.code == "NVML_ERROR_NOT_FOUND":
                return CgroupMemoryLimits(str(cgroup), 0, NVML_DEVICE_MEMORY_LIMIT_MAX, 0)
            raise
        if (seen.soft_bytes, seen.hard_bytes) != (soft_bytes, hard_bytes):
            raise MemoryLimitError(
                f"GPU {gpu_uuid}: cgroup {cgroup} reads back soft {seen.soft_bytes}, hard "
                f"{seen.hard_bytes} bytes after setting soft {soft_bytes}, hard {hard_bytes}",
                "NVML_SUCCESS",
            )
        return seen

    def clear(self, gpu_uuid: str, cgroup: Path | str) -> None:
        """No limit for the cgroup on the GPU (soft 0, hard MAX: nvml.h's way to clear)."""
        self.set(gpu_uuid, cgroup, hard_bytes=NVML_DEVICE_MEMORY_LIMIT_MAX, soft_bytes=0)

    def limit_process(
        self,
        gpu_uuid: str,
        pid: int,
        hard_bytes: int,
        *,
        proc_root: Path | str = DEFAULT_PROC_ROOT,
        cgroup_root: Path | str = DEFAULT_CGROUP_ROOT,
    ) -> CgroupMemoryLimits:
        """Hold the cgroup (v2) that process `pid` runs in (a container's own, leaf
        cgroup) to `hard_bytes` on the GPU, with no soft limit: a soft limit would be
        added to every ancestor's reservation, which a container's cgroup removed
        without clearing it first leaves behind (NVIDIA's MPS v3 memory partitioning
        guide). MemoryLimitError where the process has no cgroup v2 path here."""
        path = process_cgroup(proc_root, pid)
        if path is None:
            raise MemoryLimitError(
                f"process {pid} has no cgroup v2 path in {proc_root}/{pid}/cgroup",
                "NVML_ERROR_NOT_FOUND",
            )
        return self.set(gpu_uuid, cgroup_dir(cgroup_root, path), hard_bytes=hard_bytes)

    def _call(self, name: str, gpu_uuid: str, cgroup: Path | str, limits: Any) -> None:
        nvml = self._nvml
        try:
            [handle] = self._gpus.get(gpu_uuid)
            if handle is None:  # lost, not here, or a MIG UUID (tests only): NVML's own code
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            getattr(nvml, name)(handle, limits)
        except nvml.NVMLError as err:
            code = next((n for n in _ERROR_NAMES if is_nvml_error(nvml, err, n)), "")
            if code == "NVML_ERROR_GPU_IS_LOST":
                self._gpus.forget(gpu_uuid)
            if code in _UNAVAILABLE:
                why = (
                    "the NVIDIA driver has no per-cgroup memory limits (R615 and later)"
                    if code == "NVML_ERROR_FUNCTION_NOT_FOUND"
                    else "the device does not support per-cgroup memory limits"
                )
                raise MemoryLimitsUnavailable(f"GPU {gpu_uuid}: {why}: {err}", code) from err
            raise MemoryLimitError(
                f"GPU {gpu_uuid}: {name} on cgroup {cgroup}: {err}", code or "NVML_ERROR"
            ) from err
