"""The mock NVML's recovery action per GPU: `nvmlDeviceGetFieldValues` with
`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, and how the mock's faults change it.

`RecoveryFunctions` is mixed into `MockNvml`. The field is NONE until

- an Xid that NVIDIA's Xid catalog resolves with a GPU reset (48, 62, 95, 119, 120,
  140), or a double-bit ECC error, sets GPU_RESET on its GPU, as the driver does
  (it logs Xid 154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset
  Required)"); the first action stays until a reset. Xid 79 sets nothing: a GPU that
  fell off the bus answers no query (`gpu-dra mock lost` models that), and the
  application Xids and Xid 94 (contained) need no reset;
- `set_recovery_action(uuid, action)` (`gpu-dra mock recovery-action`) sets any
  value, NONE included, without an event (NVML sends its recovery-action event on a
  reset only, here);

and a reset (`reset(uuid)`, the `recovered` injection) sets it back to NONE. A lost
GPU answers GPU_IS_LOST to the call, a MIG device handle NOT_SUPPORTED; any other
field ID gets NOT_SUPPORTED in its own entry, as from a driver that lacks it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from driver.nvml.discovered import HealthEvent
from driver.nvml.mock.fleet import MockGpu
from driver.nvml.mock.mock_api import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
    NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    NVML_GPU_RECOVERY_ACTION_NONE,
    NVML_SUCCESS,
    NVML_VALUE_TYPE_UNSIGNED_INT,
    NVMLError,
    c_nvmlFieldValue_t,
    nvml_call,
)

# Xids whose resolution in NVIDIA's Xid catalog is a GPU reset.
RESET_XIDS = frozenset({48, 62, 95, 119, 120, 140})
MAX_ACTION = 0xFFFFFFFF


class RecoveryFunctions:
    """The recovery-action part of `MockNvml`."""

    _lock: threading.RLock
    _recovery_actions: dict[int, int]  # GPU index -> action (absent: NONE)

    if TYPE_CHECKING:

        def mock_gpu(self, uuid: str) -> MockGpu: ...

        def _not_mig(self, handle: Any) -> MockGpu: ...

    def set_recovery_action(self, uuid: str, action: int) -> None:
        """Set the GPU's recovery action as the driver would (thread-safe)."""
        if not 0 <= action <= MAX_ACTION:
            raise ValueError(f"recovery action {action} is out of range (0..{MAX_ACTION})")
        index = self.mock_gpu(uuid).index
        with self._lock:
            if action == NVML_GPU_RECOVERY_ACTION_NONE:
                self._recovery_actions.pop(index, None)
            else:
                self._recovery_actions[index] = action

    def recovery_action(self, uuid: str) -> int:
        index = self.mock_gpu(uuid).index
        with self._lock:
            return self._recovery_actions.get(index, NVML_GPU_RECOVERY_ACTION_NONE)

    def _recovery_after(self, index: int, event: HealthEvent) -> None:
        """What an injected fault does to the GPU's recovery action (under the lock)."""
        if event.kind == "recovered":
            self._recovery_actions.pop(index, None)
        elif event.kind == "ecc-dbe" or (event.kind == "xid" and event.xid in RESET_XIDS):
            self._recovery_actions.setdefault(index, NVML_GPU_RECOVERY_ACTION_GPU_RESET)

    @nvml_call
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
        gpu = self._not_mig(handle)
        values = (c_nvmlFieldValue_t * len(fieldIds))()
        for entry, field in zip(values, fieldIds, strict=True):
            try:
                entry.fieldId, entry.scopeId = field
            except TypeError:  # a bare field ID, as pynvml allows
                entry.fieldId = field
            except ValueError:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT) from None
            if entry.fieldId != NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                entry.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
                continue
            with self._lock:
                action = self._recovery_actions.get(gpu.index, NVML_GPU_RECOVERY_ACTION_NONE)
            entry.nvmlReturn = NVML_SUCCESS
            entry.valueType = NVML_VALUE_TYPE_UNSIGNED_INT
            entry.value.uiVal = action
        return values
