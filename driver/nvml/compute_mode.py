"""A GPU's compute mode through NVML: `nvmlDeviceGetComputeMode` and
`nvmlDeviceSetComputeMode` (docs/mps.md, "Strict: one MPS server, EXCLUSIVE_PROCESS").

nvml.h: `DEFAULT` (0) allows several CUDA contexts on the GPU, `EXCLUSIVE_PROCESS` (3)
one, `PROHIBITED` (2) none; `EXCLUSIVE_THREAD` (1) is no longer supported. Setting
"takes effect immediately. Under Linux it is not persistent across reboots and always
resets to Default", needs root (NO_PERMISSION), and answers NOT_SUPPORTED where the
device has no such feature and GPU_IS_LOST for a GPU that fell off the bus. On a GPU
in MIG mode the handle must be a MIG device's: this driver sets the mode only on GPUs
with MIG off.

`NvmlComputeModes` finds GPUs through `GpuHandles` (a lost GPU fails only its own
lookup); every failure is a transient `DriverError` naming the GPU and the mode.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from driver.errors import DriverError, transient
from driver.nvml.calls import CountingModule, is_nvml_error
from driver.nvml.library import GpuHandles

log = logging.getLogger(__name__)

COMPUTE_MODE_EXCLUSIVE_PROCESS: Final = 3
MODE_NAMES: Final = {
    0: "Default",
    1: "Exclusive_Thread",  # support removed (nvml.h)
    2: "Prohibited",
    COMPUTE_MODE_EXCLUSIVE_PROCESS: "Exclusive_Process",
}
_WHY: Final = {
    "NVML_ERROR_NO_PERMISSION": "setting it needs root",
    "NVML_ERROR_NOT_SUPPORTED": "the GPU does not support it",
    "NVML_ERROR_GPU_IS_LOST": "the GPU is lost",
}


def mode_name(mode: int) -> str:
    """nvidia-smi's name of a compute mode (`Exclusive_Process`), or its number."""
    return MODE_NAMES.get(mode, f"mode {mode}")


class NvmlComputeModes:
    """`ComputeModeOps` (driver/state/mps/compute_modes.py) over a counted
    pynvml-compatible module."""

    def __init__(self, nvml: CountingModule | Any, gpus: GpuHandles | None = None) -> None:
        self._nvml = nvml
        self._gpus = gpus or GpuHandles(nvml)

    def get(self, gpu_uuid: str) -> int:
        """The GPU's compute mode; a transient error where NVML cannot tell."""
        try:
            return int(self._nvml.nvmlDeviceGetComputeMode(self._handle(gpu_uuid)))
        except self._nvml.NVMLError as err:
            raise self._failure(gpu_uuid, "read the compute mode of", err) from err

    def set(self, gpu_uuid: str, mode: int) -> None:
        """Set the GPU's compute mode; a transient error naming the GPU and the mode."""
        try:
            self._nvml.nvmlDeviceSetComputeMode(self._handle(gpu_uuid), mode)
        except self._nvml.NVMLError as err:
            raise self._failure(
                gpu_uuid, f"set the compute mode {mode_name(mode)} on", err
            ) from err
        log.info("compute mode of GPU %s set to %s", gpu_uuid, mode_name(mode))

    def _failure(self, gpu_uuid: str, what: str, err: Exception) -> DriverError:
        nvml = self._nvml
        if is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
            self._gpus.forget(gpu_uuid)
        why = next((w for name, w in _WHY.items() if is_nvml_error(nvml, err, name)), "")
        return transient(f"cannot {what} GPU {gpu_uuid}: NVML: {err}{f' ({why})' if why else ''}")

    def _handle(self, gpu_uuid: str) -> Any:
        [handle] = self._gpus.get(gpu_uuid)
        if handle is None:
            raise transient(f"NVML lists no GPU {gpu_uuid} (or it is lost)")
        return handle
