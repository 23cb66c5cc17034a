"""Health events: an NVML event set over every GPU, waited on and translated into
HealthEvents (Xid, double-bit ECC, GPU lost, recovered).

A GPU whose events NVML will not register (no supported health event, or
`nvmlDeviceRegisterEvents` refused: an old driver, a vGPU) is left out of the set and
named in `unmonitored` with the reason; the other GPUs are watched as before."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from typing import Any

from driver.nvml.calls import CountingModule, is_nvml_error, nvml_text, optional_query
from driver.nvml.discovered import HealthEvent
from driver.nvml.library import init_nvml

log = logging.getLogger(__name__)

# Event types the health monitor listens to (values as in nvml.h).
EVENT_DOUBLE_BIT_ECC = 0x0002
EVENT_XID_CRITICAL = 0x0008
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_GPU_RECOVERY_ACTION = 0x8000
HEALTH_EVENT_MASK = (
    EVENT_DOUBLE_BIT_ECC | EVENT_XID_CRITICAL | EVENT_GPU_UNAVAILABLE | EVENT_GPU_RECOVERY_ACTION
)
RECOVERY_ACTION_NONE = 0
# nvmlEventData_t.gpuInstanceId / computeInstanceId when an event is not attributable
# to a MIG GPU / compute instance (nvml.h).
NO_INSTANCE = 0xFFFFFFFF


def _handle_key(handle: Any) -> object:
    if isinstance(handle, ctypes._Pointer):
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    return ("obj", id(handle))


class HealthEventSet:
    """One NVML event set over every GPU: opened, waited on, closed."""

    def __init__(self, nvml: CountingModule) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._event_handles: dict[object, str] = {}  # handle key -> GPU UUID
        self._handles_by_uuid: dict[str, Any] = {}
        self._lost: set[str] = set()
        self._pending: deque[HealthEvent] = deque()
        self._unmonitored: dict[str, str] = {}  # GPU UUID -> why its events are not watched

    def open(self) -> None:
        """Initialise NVML and register every GPU for health-relevant events."""
        nvml = self._nvml
        init_nvml(nvml)
        with self._lock:
            self._event_set = nvml.nvmlEventSetCreate()
            self._event_handles.clear()
            self._handles_by_uuid.clear()
            self._unmonitored.clear()
            for index in range(nvml.nvmlDeviceGetCount()):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = nvml_text(nvml.nvmlDeviceGetUUID(handle))
                except nvml.NVMLError as err:
                    if not is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                        raise
                    log.warning("GPU at NVML index %d is lost; no events registered", index)
                    continue
                self._event_handles[_handle_key(handle)] = uuid
                self._handles_by_uuid[uuid] = handle
                problem = self._register(handle, uuid)
                if problem is not None:
                    self._unmonitored[uuid] = problem
                    log.error("GPU %s is not monitored: %s", uuid, problem)

    def _register(self, handle: Any, uuid: str) -> str | None:
        """Register the GPU's health events in the set; why not, if it cannot be."""
        nvml = self._nvml
        try:
            supported = optional_query(
                nvml, lambda: nvml.nvmlDeviceGetSupportedEventTypes(handle), "events", uuid
            )
            mask = int(supported or 0) & HEALTH_EVENT_MASK
            if not mask:
                return "NVML reports no health event type it supports for this GPU"
            nvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
        except nvml.NVMLError as err:
            if is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                raise  # as any query of a lost GPU: the open fails and is retried
            return f"NVML cannot register its health events: {err}"
        return None

    @property
    def unmonitored(self) -> dict[str, str]:
        """GPU UUID -> why NVML does not report its health events (since `open`)."""
        with self._lock:
            return dict(self._unmonitored)

    def close(self) -> None:
        with self._lock:
            if self._event_set is None:
                return
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            finally:
                self._event_set = None
                self._nvml.nvmlShutdown()

    @property
    def monitored_uuids(self) -> tuple[str, ...]:
        return tuple(self._handles_by_uuid)

    def wait(self, timeout_ms: int) -> HealthEvent | None:
        """The next health event, or None when `timeout_ms` passes without one.

        Xid and double-bit ECC events map to `xid` / `ecc-dbe` (an Xid keeps the MIG
        GPU / compute instance NVML attributes it to, if any); NVML's "GPU is lost"
        (from the wait itself, or a GpuUnavailable event) maps to `gpu-lost` for each
        newly lost GPU; a GpuRecoveryAction event with action NONE maps to `recovered`.
        """
        if self._pending:
            return self._pending.popleft()
        if self._event_set is None:
            raise RuntimeError("open_event_set() first")
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except nvml.NVMLError as err:
            if is_nvml_error(nvml, err, "NVML_ERROR_TIMEOUT"):
                return None
            if is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                self._probe_lost()
                if not self._pending:
                    time.sleep(timeout_ms / 1000.0)  # the wait returned at once; don't spin
                return self._pending.popleft() if self._pending else None
            raise
        return self._translate(data)

    def _uuid_of(self, handle: Any) -> str | None:
        uuid = self._event_handles.get(_handle_key(handle))
        if uuid is not None:
            return uuid
        try:
            return nvml_text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return None

    def _translate(self, data: Any) -> HealthEvent | None:
        uuid = self._uuid_of(data.device)
        if uuid is None:
            log.warning("NVML event %#x for an unknown device", int(data.eventType))
            return None
        etype, edata = int(data.eventType), int(data.eventData)
        if etype & EVENT_XID_CRITICAL:
            return HealthEvent(uuid, "xid", edata, f"Xid {edata}", *_instance_ids(data))
        if etype & EVENT_DOUBLE_BIT_ECC:
            return HealthEvent(uuid, "ecc-dbe", message="double-bit ECC error")
        if etype & EVENT_GPU_UNAVAILABLE:
            if uuid in self._lost:
                return None
            self._lost.add(uuid)
            return HealthEvent(uuid, "gpu-lost", message="GPU unavailable")
        if etype & EVENT_GPU_RECOVERY_ACTION:
            if edata == RECOVERY_ACTION_NONE:
                self._lost.discard(uuid)
                return HealthEvent(uuid, "recovered", message="no recovery action needed")
            log.warning("GPU %s needs recovery action %d", uuid, edata)
            return None
        log.debug("ignoring NVML event %#x on %s", etype, uuid)
        return None

    def _probe_lost(self) -> None:
        """After GPU_IS_LOST from a wait: find which registered GPUs stopped answering."""
        nvml = self._nvml
        for uuid, handle in self._handles_by_uuid.items():
            if uuid in self._lost:
                continue
            try:
                nvml.nvmlDeviceGetUUID(handle)
            except nvml.NVMLError as err:
                if is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                    self._lost.add(uuid)
                    self._pending.append(HealthEvent(uuid, "gpu-lost", message=str(err)))


def _instance_ids(data: Any) -> tuple[int | None, int | None]:
    """The MIG GPU instance and compute instance an Xid event is attributed to.

    nvml.h: "If MIG is enabled and nvmlEventTypeXidCriticalError event is attributable
    to a GPU instance, stores a valid GPU instance ID. gpuInstanceId is set to
    0xFFFFFFFF otherwise" (computeInstanceId likewise). A compute instance lives in a
    GPU instance, so a compute instance ID without a GPU instance ID is dropped."""
    gi = int(getattr(data, "gpuInstanceId", NO_INSTANCE))
    ci = int(getattr(data, "computeInstanceId", NO_INSTANCE))
    if gi == NO_INSTANCE:
        return None, None
    return gi, None if ci == NO_INSTANCE else ci
