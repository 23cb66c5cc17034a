"""NVML's errors of a MIG operation as a `MigError`: the NVML code's name, whether a
retry can help, whether the parent GPU is gone (driver/nvml/mig/mig_manager.py, docs/mig.md)."""

from __future__ import annotations

from typing import Any


class MigError(RuntimeError):
    """A MIG operation NVML refused. `code` is the NVML return code name (e.g.
    `NVML_ERROR_INSUFFICIENT_RESOURCES`); `retryable` says whether the same call can
    succeed later without a change by an administrator; `gpu_gone`: the parent GPU
    is lost (fell off the bus) or no longer on this node, and so are its MIG devices.
    `left_gi_id`: a failed create made this GPU instance and could not destroy it
    again; whoever records the attempt destroys it by that id."""

    def __init__(self, message: str, *, code: str, retryable: bool, gpu_gone: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.gpu_gone = gpu_gone
        self.left_gi_id: int | None = None


# NVML return codes that no retry fixes without someone changing the GPU's setup.
_NOT_RETRYABLE = frozenset(
    {
        "NVML_ERROR_NOT_SUPPORTED",  # MIG mode off, or profile unsupported
        "NVML_ERROR_INVALID_ARGUMENT",  # placement not possible for the profile
        "NVML_ERROR_NO_PERMISSION",  # the plugin lacks the MIG capability
    }
)
_KNOWN_ERRORS = (
    "NVML_ERROR_INSUFFICIENT_RESOURCES",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_IN_USE",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    "NVML_ERROR_IRQ_ISSUE",
    "NVML_ERROR_INSUFFICIENT_POWER",
    "NVML_ERROR_TIMEOUT",
    "NVML_ERROR_UNKNOWN",
)


def error_code(nvml: Any, err: BaseException) -> str:
    """The name of the NVML return code of `err` (e.g. `NVML_ERROR_NOT_FOUND`)."""
    value = getattr(err, "value", None)
    for name in _KNOWN_ERRORS:
        if getattr(nvml, name, None) == value:
            return name
    return f"NVML error {value}"


def mig_error(nvml: Any, err: BaseException, what: str, *, lookup: bool = False) -> MigError:
    """`err` as a MigError. `lookup`: from finding the GPU itself, where NOT_FOUND
    means the GPU is not on this node (elsewhere it names an instance)."""
    code = error_code(nvml, err)
    gone = code == "NVML_ERROR_GPU_IS_LOST" or (lookup and code == "NVML_ERROR_NOT_FOUND")
    return MigError(
        f"{what}: {err} ({code})",
        code=code,
        retryable=code not in _NOT_RETRYABLE,
        gpu_gone=gone,
    )
