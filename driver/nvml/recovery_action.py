"""NVML's recovery action per GPU: what the driver says a GPU needs before it can be
trusted again (nothing, a GPU reset, a node reboot, draining peer-to-peer traffic, ...).

Read with `nvmlDeviceGetFieldValues` and the field `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`
(nvml.h; driver R565 and later). NVML answers per field: the call succeeds when any
field was read and each entry carries its own `nvmlReturn`, so an old driver answers
the call with the field's entry set to NOT_SUPPORTED (or INVALID_ARGUMENT for a field
ID it does not know).

`RecoveryActionReader.read(uuids)` reads the field of each GPU and never raises for
one GPU's answer: each `RecoveryReading` says the action, that the driver does not
report one, or why the GPU did not answer (lost, an NVML error). It keeps the GPUs'
handles (`GpuHandles`), so a steady read costs one NVML call per GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from driver.nvml.calls import CountingModule, is_nvml_error
from driver.nvml.library import GpuHandles

log = logging.getLogger(__name__)

FIELD_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
ACTION_NONE = 0
# nvmlDeviceGpuRecoveryAction_t (nvml.h, pynvml's NVML_GPU_RECOVERY_ACTION_*): the
# names operators see in taint values and in `gpu-dra mock recovery-action`.
ACTION_NAMES: Mapping[int, str] = {
    ACTION_NONE: "none",
    1: "gpu-reset",
    2: "node-reboot",
    3: "drain-p2p",
    4: "drain-and-reset",
    5: "recover-imex-domain",
    6: "bus-reset",
    7: "system-reboot",
}
MAX_ACTION = 0xFFFFFFFF  # an unsigned int in NVML

# nvmlValueType_t -> the member of nvmlValue_t that holds the value.
_VALUE_MEMBERS = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}
_NVML_SUCCESS = 0
# A field an old driver does not know: its entry says so, the call itself succeeds.
_FIELD_UNSUPPORTED = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT")
# A library without the function at all.
_CALL_UNSUPPORTED = ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED")


def action_name(action: int) -> str:
    """`gpu-reset` for 1; `action-<n>` for a value this driver does not know."""
    return ACTION_NAMES.get(action, f"action-{action}")


def parse_action(text: str) -> int:
    """A recovery action by name (`gpu-reset`, NVML's `GPU_RESET`, any case) or number;
    ValueError saying what is accepted."""
    word = text.strip().lower().replace("_", "-")
    for code, name in ACTION_NAMES.items():
        if word == name:
            return code
    try:
        code = int(word, 10)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a recovery action (one of {', '.join(ACTION_NAMES.values())}, "
            f"or a number 0..{MAX_ACTION})"
        ) from None
    if not 0 <= code <= MAX_ACTION:
        raise ValueError(f"recovery action {code} is out of range (0..{MAX_ACTION})")
    return code


@dataclass(frozen=True)
class RecoveryReading:
    """One GPU's recovery action as NVML answered it."""

    gpu_uuid: str
    action: int | None  # None: not read (see `supported` and `error`)
    supported: bool = True  # False: this driver does not report recovery actions
    error: str = ""  # why the GPU did not answer (it is lost, an NVML error)

    @property
    def answered(self) -> bool:
        return self.action is not None


class RecoveryActionReader:
    """Reads the recovery action of GPUs through a counted pynvml-compatible module."""

    def __init__(self, nvml: CountingModule, gpus: GpuHandles | None = None) -> None:
        self._nvml = nvml
        self._gpus = gpus or GpuHandles(nvml)

    def read(self, uuids: Iterable[str]) -> list[RecoveryReading]:
        """The recovery action of each GPU in `uuids`, in that order. Raises only
        when NVML cannot be initialised at all."""
        wanted = list(uuids)
        return [self._read_one(u, h) for u, h in zip(wanted, self._gpus.get(*wanted), strict=True)]

    def _read_one(self, uuid: str, handle: Any) -> RecoveryReading:
        nvml = self._nvml
        if handle is None:
            return RecoveryReading(uuid, None, error="NVML lists no such GPU (or it is lost)")
        try:
            values = nvml.nvmlDeviceGetFieldValues(handle, [FIELD_RECOVERY_ACTION])
        except nvml.NVMLError as err:
            if is_nvml_error(nvml, err, *_CALL_UNSUPPORTED):
                return RecoveryReading(uuid, None, supported=False, error=str(err))
            if is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                self._gpus.forget(uuid)
            return RecoveryReading(uuid, None, error=str(err))
        entry = values[0]
        code = int(entry.nvmlReturn)
        if code != _NVML_SUCCESS:
            error = nvml.NVMLError(code)
            supported = not is_nvml_error(nvml, error, *_FIELD_UNSUPPORTED)
            return RecoveryReading(uuid, None, supported=supported, error=str(error))
        member = _VALUE_MEMBERS.get(int(entry.valueType))
        if member is None:
            return RecoveryReading(uuid, None, error=f"value type {int(entry.valueType)}")
        return RecoveryReading(uuid, int(getattr(entry.value, member)))
