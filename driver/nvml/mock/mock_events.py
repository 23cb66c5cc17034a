"""The mock NVML's health events: injection (tests, demos, `gpu-dra mock`) and pynvml's
event-set functions that deliver them.

`EventFunctions` is mixed into `MockNvml`. An Xid or double-bit ECC error makes the next
`nvmlEventSetWait*` return it (an Xid attributed to a MIG GPU / compute instance carries
their IDs in the event data); `gpu-lost` makes every query on that GPU raise
`GPU_IS_LOST` (and the next wait raise it) until a `recovered` (reset) injection, which
the next wait reports as a `GpuRecoveryAction` event with action NONE. An injection
also sets the GPU's recovery action as the driver would (`driver/nvml/mock/mock_recovery.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from driver.nvml.discovered import HealthEvent
from driver.nvml.mock.fleet import MockGpu
from driver.nvml.mock.mock_api import (
    NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_GPU_RECOVERY_ACTION_NONE,
    EventData,
    MockEventSet,
    NVMLError,
    nvml_call,
    nvmlEventTypeAll,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeGpuRecoveryAction,
    nvmlEventTypeXidCriticalError,
)


@dataclass
class PendingEvent:
    index: int
    event_type: int  # 0 = "GPU is lost" (the wait raises GPU_IS_LOST)
    event_data: int = 0
    gpu_instance_id: int = NO_INSTANCE
    compute_instance_id: int = NO_INSTANCE


# What a real H200 (driver 580.159.04, MIG off) answered to
# nvmlDeviceGetSupportedEventTypes: every type nvml.h defines (nvmlEventTypeAll); the
# mock raises only Xid, ECC, GPU-unavailable and recovery-action events.
SUPPORTED_EVENTS = nvmlEventTypeAll


class EventFunctions:
    """The event part of `MockNvml`: injection and pynvml's event-set functions."""

    gpus: list[MockGpu]
    _handles: Sequence[Any]
    _lock: threading.RLock
    _cond: threading.Condition
    _lost: set[int]
    _pending: list[PendingEvent]

    if TYPE_CHECKING:

        def mock_gpu(self, uuid: str) -> MockGpu: ...

        def _not_mig(self, handle: Any) -> MockGpu: ...

        def _recovery_after(self, index: int, event: HealthEvent) -> None: ...

    def inject(self, event: HealthEvent) -> None:
        """Inject a health event for a GPU (thread-safe); see the module docstring.

        An Xid may carry `gpu_instance_id` / `compute_instance_id` (a GPU in MIG mode
        only, as in NVML): the wait reports them in the event data, 0xFFFFFFFF where
        None. Whether that instance exists is not checked (an event can outlive it)."""
        gpu = self.mock_gpu(event.gpu_uuid)
        gi, ci = self._instance_ids(gpu, event)
        with self._cond:
            if event.kind == "xid":
                if event.xid is None:
                    raise ValueError("an xid event needs an xid number")
                self._pending.append(
                    PendingEvent(gpu.index, nvmlEventTypeXidCriticalError, event.xid, gi, ci)
                )
            elif event.kind == "ecc-dbe":
                self._pending.append(PendingEvent(gpu.index, nvmlEventTypeDoubleBitEccError))
            elif event.kind == "gpu-lost":
                self._lost.add(gpu.index)
                self._pending.append(PendingEvent(gpu.index, 0))
            elif event.kind == "recovered":
                self._lost.discard(gpu.index)
                self._pending = [p for p in self._pending if p.index != gpu.index]
                self._pending.append(
                    PendingEvent(
                        gpu.index, nvmlEventTypeGpuRecoveryAction, NVML_GPU_RECOVERY_ACTION_NONE
                    )
                )
            else:
                raise ValueError(f"unknown health event kind {event.kind!r}")
            self._recovery_after(gpu.index, event)
            self._cond.notify_all()

    @staticmethod
    def _instance_ids(gpu: MockGpu, event: HealthEvent) -> tuple[int, int]:
        gi, ci = event.gpu_instance_id, event.compute_instance_id
        if gi is None and ci is None:
            return NO_INSTANCE, NO_INSTANCE
        if event.kind != "xid":
            raise ValueError(f"NVML attributes only Xid events to a MIG instance, not {event.kind}")
        if not gpu.mig_enabled:
            raise ValueError(f"GPU {gpu.uuid} is not in MIG mode: no event has a GPU instance")
        if gi is None:
            raise ValueError("a compute instance ID needs its GPU instance ID")
        for value in (gi, ci):
            if value is not None and not 0 <= value < NO_INSTANCE:
                raise ValueError(f"instance ID {value} is out of range")
        return gi, NO_INSTANCE if ci is None else ci

    def inject_xid(
        self,
        uuid: str,
        xid: int,
        *,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> None:
        self.inject(
            HealthEvent(
                gpu_uuid=uuid,
                kind="xid",
                xid=xid,
                gpu_instance_id=gpu_instance_id,
                compute_instance_id=compute_instance_id,
            )
        )

    def inject_gpu_lost(self, uuid: str) -> None:
        self.inject(HealthEvent(gpu_uuid=uuid, kind="gpu-lost"))

    def reset(self, uuid: str) -> None:
        self.inject(HealthEvent(gpu_uuid=uuid, kind="recovered"))

    def is_lost(self, uuid: str) -> bool:
        with self._lock:
            return self.mock_gpu(uuid).index in self._lost

    # ------------------------------------------------------------ pynvml event sets

    @nvml_call
    def nvmlEventSetCreate(self) -> MockEventSet:
        return MockEventSet()

    @nvml_call
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._not_mig(handle)  # no per-MIG-device events (nvml.h)
        return SUPPORTED_EVENTS

    @nvml_call
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._not_mig(handle)
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if eventTypes & ~SUPPORTED_EVENTS:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            eventSet.registered[gpu.index] = eventSet.registered.get(gpu.index, 0) | eventTypes

    def _take(self, event_set: MockEventSet) -> PendingEvent | None:
        for i, p in enumerate(self._pending):
            mask = event_set.registered.get(p.index)
            if mask is None:
                continue
            if p.event_type == 0 or p.event_type & mask:
                del self._pending[i]
                return p
        return None

    @nvml_call
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> EventData:
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        deadline = time.monotonic() + max(timeoutms, 0) / 1000.0
        with self._cond:
            while True:
                pending = self._take(eventSet)
                if pending is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NVMLError(NVML_ERROR_TIMEOUT)
                self._cond.wait(remaining)
        if pending.event_type == 0:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return EventData(
            device=self._handles[pending.index],
            eventType=pending.event_type,
            eventData=pending.event_data,
            gpuInstanceId=pending.gpu_instance_id,
            computeInstanceId=pending.compute_instance_id,
        )

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @nvml_call
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        eventSet.freed = True
