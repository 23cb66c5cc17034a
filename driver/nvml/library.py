"""Making NVML available: loading libnvidia-ml from the driver root, initialising it,
and finding GPUs' handles."""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

from driver.nvml.calls import is_nvml_error, nvml_text

log = logging.getLogger(__name__)

NVML_LIBRARY = "libnvidia-ml.so.1"
# Distribution layouts first; then a driver root without usr/ (GKE keeps the driver
# in /home/kubernetes/bin/nvidia/lib64).
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib64",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib",
)


class NvmlUnavailableError(RuntimeError):
    """The NVML library cannot be loaded or initialised on this host."""


def load_library_from_driver_root(pynvml: Any, driver_root: str) -> None:
    """Loads libnvidia-ml from the mounted driver root (the chart mounts it at
    /driver-root) instead of the container's loader path; pointing LD_LIBRARY_PATH at
    the host's library directory would pull in the host's libc too."""
    if not driver_root or driver_root == "/":
        return
    for directory in LIBRARY_DIRS:
        candidate = Path(driver_root) / directory / NVML_LIBRARY
        if candidate.exists():
            log.info("loading NVML from %s", candidate)
            pynvml.nvmlLib = ctypes.CDLL(str(candidate))
            return
    raise NvmlUnavailableError(
        f"NVIDIA driver root (--nvidia-driver-root, NVIDIA_DRIVER_ROOT) {driver_root}: "
        f"no {NVML_LIBRARY} under " + ", ".join(f"{driver_root}/{d}" for d in LIBRARY_DIRS)
    )


def init_nvml(nvml: Any) -> None:
    """`nvmlInit`; a host without the library or the kernel driver is NvmlUnavailableError."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        if is_nvml_error(nvml, err, "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"):
            raise NvmlUnavailableError(
                f"NVML is not available on this host ({err}); "
                "for mock GPUs use gpu-kubelet-plugin --nvml-backend=mock "
                "or gpu-dra inventory --mock"
            ) from err
        raise


class GpuHandles:
    """One `nvmlInit` for the process's lifetime and the GPUs' handles, found by index:
    a lookup by UUID fails for every GPU while any one is lost (nvml.h). The backend
    keeps one for all its readers (`driver.nvml.backend`): one scan serves them all,
    and a handle a lost GPU made stale is forgotten for all of them."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: dict[str, Any] = {}

    def get(self, *uuids: str) -> list[Any | None]:
        """The GPUs' handles (None: no GPU that answers has the UUID); initialises NVML
        first, and looks every GPU up again when any of `uuids` is not known."""
        nvml = self._nvml
        with self._lock:
            if not self._initialised:
                init_nvml(nvml)
                self._initialised = True
            if any(uuid not in self._handles for uuid in uuids):
                for index in range(nvml.nvmlDeviceGetCount()):
                    try:
                        handle = nvml.nvmlDeviceGetHandleByIndex(index)
                        self._handles[nvml_text(nvml.nvmlDeviceGetUUID(handle))] = handle
                    except nvml.NVMLError as err:
                        log.debug("no handle for the GPU at index %d: %s", index, err)
            return [self._handles.get(uuid) for uuid in uuids]

    def forget(self, uuid: str) -> None:
        """After GPU_IS_LOST: a lost GPU's handle is stale once it is back."""
        with self._lock:
            self._handles.pop(uuid, None)
