"""NVML discovery and health events over a pynvml-compatible module.

`NvmlBackend(module)` takes the real `pynvml` module or a `MockNvml` instance and only
calls functions that exist in real pynvml (tests/unit/test_pynvml_contract.py checks
names and signatures). NOT_SUPPORTED answers leave optional fields None and never
fail discovery.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from driver.nvml.mig import MigManager
from driver.nvml.types import GpuInfo, HealthEvent, Inventory, PartitionProfile

log = logging.getLogger(__name__)

_T = TypeVar("_T")

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

ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}


class NvmlUnavailableError(RuntimeError):
    """The NVML library cannot be loaded or initialised on this host."""


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """`00000000:3B:00.0` -> `0000:3b:00.0` (lower case, 4-hex-digit domain)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().rstrip("\x00").lower()
    domain, sep, rest = text.partition(":")
    if sep and len(domain) == 8 and domain.startswith("0000"):
        domain = domain[4:]
    return f"{domain}{sep}{rest}"


def format_cuda_driver_version(version: int) -> str:
    """NVML's integer CUDA driver version (13000, 12040) -> "13.0", "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _handle_key(handle: Any) -> object:
    if isinstance(handle, ctypes._Pointer):
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    return ("obj", id(handle))


class _CountingModule:
    """Counts calls of the module's `nvml*` functions per calling thread; everything
    else passes through.

    The counts back the `gpu_dra_nvml_calls{caller=...}` metric, which is how tests and
    operators see that a remembered permanent verdict costs no NVML call while the
    health monitor keeps polling for events on its own thread.
    """

    def __init__(self, module: Any) -> None:
        self.wrapped = module
        self.counts: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.wrapped, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[threading.current_thread().name] += 1
            return value(*args, **kwargs)

        return counted


class NvmlBackend:
    """Discovery and health events through a pynvml-compatible module."""

    def __init__(self, module: Any, *, backend_name: str | None = None) -> None:
        self._nvml = _CountingModule(module)
        if backend_name is None:
            from driver.nvml.mock import MockNvml

            backend_name = "mock" if isinstance(module, MockNvml) else "nvml"
        self.backend_name = backend_name
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._event_handles: dict[object, str] = {}  # handle key -> GPU UUID
        self._handles_by_uuid: dict[str, Any] = {}
        self._lost: set[str] = set()
        self._pending: deque[HealthEvent] = deque()

    @property
    def module(self) -> Any:
        return self._nvml.wrapped

    def mig(self) -> MigManager:
        """The MIG lifecycle on this backend's GPUs (calls are counted like all others)."""
        return MigManager(self._nvml)

    @property
    def nvml_calls(self) -> dict[str, int]:
        """NVML functions called through this backend since it was created, by the
        name of the calling thread."""
        return dict(self._nvml.counts)

    # ------------------------------------------------------------ errors

    def _is(self, err: BaseException, name: str) -> bool:
        code = getattr(self._nvml, name, None)
        return isinstance(err, self._nvml.NVMLError) and getattr(err, "value", None) == code

    def _optional(self, fn: Callable[[], _T], what: str, uuid: str = "") -> _T | None:
        """Call `fn`; NOT_SUPPORTED (and friends) mean "no such attribute", not a failure."""
        try:
            return fn()
        except self._nvml.NVMLError as err:
            if self._is(err, "NVML_ERROR_GPU_IS_LOST"):
                raise
            if any(
                self._is(err, n)
                for n in (
                    "NVML_ERROR_NOT_SUPPORTED",
                    "NVML_ERROR_FUNCTION_NOT_FOUND",
                    "NVML_ERROR_NO_PERMISSION",
                )
            ):
                log.debug("NVML %s not available %s: %s", what, uuid, err)
                return None
            raise

    # ------------------------------------------------------------ discovery

    def _init(self) -> None:
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as err:
            if self._is(err, "NVML_ERROR_LIBRARY_NOT_FOUND") or self._is(
                err, "NVML_ERROR_DRIVER_NOT_LOADED"
            ):
                raise NvmlUnavailableError(
                    f"NVML is not available on this host ({err}); "
                    "for mock GPUs use gpu-kubelet-plugin --nvml-backend=mock "
                    "or gpu-dra inventory --mock"
                ) from err
            raise

    def discover(self) -> Inventory:
        """Walk every GPU NVML reports; GPUs that are lost are skipped with a warning."""
        self._init()
        try:
            driver_version = _text(self._nvml.nvmlSystemGetDriverVersion())
            cuda = self._optional(self._nvml.nvmlSystemGetCudaDriverVersion, "CUDA version")
            gpus: list[GpuInfo] = []
            for index in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    gpus.append(self._gpu_info(index, handle))
                except self._nvml.NVMLError as err:
                    if not self._is(err, "NVML_ERROR_GPU_IS_LOST"):
                        raise
                    log.warning("GPU at NVML index %d is lost; not published: %s", index, err)
            return Inventory(
                backend=self.backend_name,
                driver_version=driver_version,
                cuda_driver_version=format_cuda_driver_version(cuda) if cuda else None,
                gpus=tuple(gpus),
            )
        finally:
            self._nvml.nvmlShutdown()

    def _gpu_info(self, index: int, handle: Any) -> GpuInfo:
        nvml = self._nvml
        minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        product_name = _text(nvml.nvmlDeviceGetName(handle))
        pci_bus_id = normalize_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
        memory = self._optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), "memory", uuid)
        brand = self._optional(lambda: nvml.nvmlDeviceGetBrand(handle), "brand", uuid)
        arch = self._optional(lambda: nvml.nvmlDeviceGetArchitecture(handle), "arch", uuid)
        cc = self._optional(lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle), "cc", uuid)
        mig_mode = self._optional(lambda: nvml.nvmlDeviceGetMigMode(handle), "MIG mode", uuid)
        mig_capable = mig_mode is not None
        mig_enabled = mig_mode is not None and int(mig_mode[0]) == nvml.NVML_DEVICE_MIG_ENABLE
        profiles = self._partition_profiles(handle, uuid) if mig_capable else ()
        instances = (
            tuple(self.mig().instances(uuid, initialised=True)) if mig_enabled and profiles else ()
        )
        overrides = self._mock_overrides(uuid)
        return GpuInfo(
            index=index,
            minor=minor,
            uuid=uuid,
            product_name=product_name,
            pci_bus_id=pci_bus_id,
            memory_bytes=int(memory.total) if memory is not None else None,
            brand=BRANDS.get(int(brand), "Unknown") if brand is not None else None,
            architecture=ARCHITECTURES.get(int(arch), "Unknown") if arch is not None else None,
            cuda_compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
            mig_capable=mig_capable,
            mig_enabled=mig_enabled,
            memory_slices=max((s + n for p in profiles for s, n in p.placements), default=0),
            multiprocessors=max((p.multiprocessors for p in profiles), default=None),
            partition_profiles=profiles,
            mig_instances=instances,
            model=overrides.get("model"),
            reference_example=bool(overrides.get("reference_example", False)),
        )

    def _mock_overrides(self, uuid: str) -> dict[str, Any]:
        """Published-model overrides the mock's `example` profile carries (not NVML)."""
        from driver.nvml.mock import MockNvml

        if not isinstance(self._nvml.wrapped, MockNvml):
            return {}
        gpu = self._nvml.wrapped.mock_gpu(uuid)
        if gpu.profile.referenceExample:
            return {"model": gpu.profile.productName, "reference_example": True}
        return {}

    def _partition_profiles(self, handle: Any, uuid: str) -> tuple[PartitionProfile, ...]:
        nvml = self._nvml
        profiles: list[PartitionProfile] = []
        for slot in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, slot)
                placements = self._placements(handle, int(info.id))
            except nvml.NVMLError as err:
                if self._is(err, "NVML_ERROR_NOT_SUPPORTED") or self._is(
                    err, "NVML_ERROR_INVALID_ARGUMENT"
                ):
                    continue
                raise
            name = _text(info.name).strip().removeprefix("MIG ").strip()
            if not name or not placements:
                continue
            profiles.append(
                PartitionProfile(
                    name=name,
                    profile_id=int(info.id),
                    slice_count=int(info.sliceCount),
                    memory_bytes=int(info.memorySizeMB) * 1024 * 1024,
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg_engines=int(info.jpegCount),
                    ofa_engines=int(info.ofaCount),
                    placements=placements,
                    instance_count=int(info.instanceCount),
                )
            )
        log.debug("GPU %s: %d MIG profiles", uuid, len(profiles))
        return tuple(profiles)

    def _placements(self, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
        nvml = self._nvml
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, None, ctypes.pointer(count)
        )
        if count.value == 0:
            return ()
        array = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, array, ctypes.pointer(count)
        )
        return tuple((int(array[i].start), int(array[i].size)) for i in range(count.value))

    # ------------------------------------------------------------ health events

    def open_event_set(self) -> None:
        """Initialise NVML and register every GPU for health-relevant events."""
        nvml = self._nvml
        self._init()
        with self._lock:
            self._event_set = nvml.nvmlEventSetCreate()
            self._event_handles.clear()
            self._handles_by_uuid.clear()
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                except nvml.NVMLError as err:
                    if not self._is(err, "NVML_ERROR_GPU_IS_LOST"):
                        raise
                    log.warning("GPU at NVML index %d is lost; no events registered", index)
                    continue
                self._event_handles[_handle_key(handle)] = uuid
                self._handles_by_uuid[uuid] = handle
                supported = self._optional(
                    functools.partial(nvml.nvmlDeviceGetSupportedEventTypes, handle),
                    "events",
                    uuid,
                )
                mask = int(supported or 0) & HEALTH_EVENT_MASK
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
                else:
                    log.warning("GPU %s supports no health events", uuid)

    def close_event_set(self) -> None:
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

    def wait_event(self, timeout_ms: int) -> HealthEvent | None:
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
            if self._is(err, "NVML_ERROR_TIMEOUT"):
                return None
            if self._is(err, "NVML_ERROR_GPU_IS_LOST"):
                self._probe_lost()
                if not self._pending:
                    time.sleep(timeout_ms / 1000.0)  # the wait returned at once; don't spin
                return self._pending.popleft() if self._pending else None
            raise
        event = self._translate(data)
        if event is not None:
            self._pending.append(event)
        return self._pending.popleft() if self._pending else None

    def _uuid_of(self, handle: Any) -> str | None:
        uuid = self._event_handles.get(_handle_key(handle))
        if uuid is not None:
            return uuid
        try:
            return _text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return None

    def _translate(self, data: Any) -> HealthEvent | None:
        uuid = self._uuid_of(data.device)
        if uuid is None:
            log.warning("NVML event %#x for an unknown device", int(data.eventType))
            return None
        etype, edata = int(data.eventType), int(data.eventData)
        if etype & EVENT_XID_CRITICAL:
            gi, ci = _instance_ids(data)
            return HealthEvent(
                uuid,
                "xid",
                xid=edata,
                message=f"Xid {edata}",
                gpu_instance_id=gi,
                compute_instance_id=ci,
            )
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
        for uuid, handle in self._handles_by_uuid.items():
            if uuid in self._lost:
                continue
            try:
                self._nvml.nvmlDeviceGetUUID(handle)
            except self._nvml.NVMLError as err:
                if self._is(err, "NVML_ERROR_GPU_IS_LOST"):
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


def select_backend(
    *,
    mock: bool,
    fleet_path: str | Path | None = None,
    node_name: str = "",
    mock_driver_root: Path | None = None,
) -> NvmlBackend:
    """The backend for this process: real pynvml, or (explicitly chosen) a mock fleet.

    The mock is logged loudly at WARNING: its devices must never be published by
    accident on a real GPU node.
    """
    if mock:
        from driver.nvml.fleet import resolve_fleet
        from driver.nvml.mock import MockNvml

        if not node_name:
            raise ValueError("the mock backend needs a node name (UUIDs derive from it)")
        fleet = resolve_fleet(fleet_path)
        count = sum(g.count for g in fleet.gpus)
        log.warning(
            "USING MOCK NVML: %d fake GPU(s) (%s) for node %s from %s; these are not real devices",
            count,
            ", ".join(f"{g.count}x{g.model}" for g in fleet.gpus),
            node_name,
            fleet_path or "the built-in default fleet",
        )
        return NvmlBackend(MockNvml(fleet, node_name, driver_root=mock_driver_root))
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - pynvml is a hard dependency
        raise NvmlUnavailableError(f"pynvml is not installed: {err}") from err
    _load_library_from_driver_root(pynvml, os.environ.get("NVIDIA_DRIVER_ROOT", ""))
    return NvmlBackend(pynvml)


NVML_LIBRARY = "libnvidia-ml.so.1"
_LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/lib")


def _load_library_from_driver_root(pynvml: Any, driver_root: str) -> None:
    """Loads libnvidia-ml from the mounted driver root (the chart mounts it at
    /driver-root) instead of the container's loader path; pointing LD_LIBRARY_PATH at
    the host's library directory would pull in the host's libc too."""
    if not driver_root or driver_root == "/":
        return
    for directory in _LIBRARY_DIRS:
        candidate = Path(driver_root) / directory / NVML_LIBRARY
        if candidate.exists():
            log.info("loading NVML from %s", candidate)
            pynvml.nvmlLib = ctypes.CDLL(str(candidate))
            return
    raise NvmlUnavailableError(
        f"NVIDIA_DRIVER_ROOT={driver_root}: no {NVML_LIBRARY} under "
        + ", ".join(f"{driver_root}/{d}" for d in _LIBRARY_DIRS)
    )
