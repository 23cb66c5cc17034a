"""MockNvml: a pynvml-compatible fake NVML built from a mock fleet.

An instance stands in for the `pynvml` module: the same function names, arguments,
return shapes, constants and `NVMLError` subclasses (with NVML's numeric codes), so
`NvmlBackend` runs unchanged on real pynvml and on the mock. Nothing here imports or
copies pynvml; names and values mirror its public API (nvidia-ml-py 13.x).

Extras for tests and demos (not part of pynvml):
- `calls`: a `collections.Counter` of every NVML function called through the mock
  (`mock.calls.total() == 0` asserts "no NVML call").
- `inject(event)`: thread-safe health injection. An Xid or double-bit ECC error makes
  the next `nvmlEventSetWait*` return it (an Xid attributed to a MIG GPU / compute
  instance carries their IDs in the event data); `gpu-lost` makes every query on that GPU
  raise `GPU_IS_LOST` (and the next wait raise it) until a `recovered` (reset)
  injection, which the next wait reports as a `GpuRecoveryAction` event with
  action NONE.
- `mock_gpu(uuid)`: the fleet entry behind a GPU.
- MIG instances (`driver/nvml/mock_mig.py`): GPU and compute instances and MIG device
  handles, kept in memory or, given `driver_root`, in a state file under it shared by
  every process on that root; `mock_reboot()` drops the dynamic ones.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.nvml import mock_mig
from driver.nvml.fleet import Fleet, MigProfileSpec, MockGpu, expand_fleet
from driver.nvml.mock_mig import MigFunctions, get_out_uint, nvml_call, set_out_uint
from driver.nvml.mock_mig_state import (
    MockMigDeviceHandle,
    c_nvmlComputeInstance_t,
    c_nvmlGpuInstance_t,
)
from driver.nvml.types import HealthEvent

# --------------------------------------------------------------------------- constants
# Values as defined by NVML (nvml.h) and exposed by pynvml under these names.

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_UNKNOWN = 999

NVML_INIT_FLAG_NO_GPUS = 1
NVML_INIT_FLAG_NO_ATTACH = 2

NVML_BRAND_UNKNOWN = 0
NVML_BRAND_QUADRO = 1
NVML_BRAND_TESLA = 2
NVML_BRAND_NVS = 3
NVML_BRAND_GRID = 4
NVML_BRAND_GEFORCE = 5
NVML_BRAND_TITAN = 6
NVML_BRAND_NVIDIA_VAPPS = 7
NVML_BRAND_NVIDIA_VPC = 8
NVML_BRAND_NVIDIA_VCS = 9
NVML_BRAND_NVIDIA_VWS = 10
NVML_BRAND_NVIDIA_CLOUD_GAMING = 11
NVML_BRAND_QUADRO_RTX = 12
NVML_BRAND_NVIDIA_RTX = 13
NVML_BRAND_NVIDIA = 14
NVML_BRAND_GEFORCE_RTX = 15
NVML_BRAND_TITAN_RTX = 16

NVML_DEVICE_ARCH_KEPLER = 2
NVML_DEVICE_ARCH_MAXWELL = 3
NVML_DEVICE_ARCH_PASCAL = 4
NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_ARCH_TURING = 6
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
NVML_DEVICE_ARCH_RUBIN = 13
NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_GPU_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_GPU_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 = 0x8
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 0x9
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12

nvmlGpuInstanceProfileInfo_v2 = 0x02000098
nvmlMemory_v2 = 0x02000028

nvmlEventTypeSingleBitEccError = 0x0001
nvmlEventTypeDoubleBitEccError = 0x0002
nvmlEventTypePState = 0x0004
nvmlEventTypeXidCriticalError = 0x0008
nvmlEventTypeClock = 0x0010
nvmlEventTypePowerSourceChange = 0x0080
nvmlEventMigConfigChange = 0x0100
nvmlEventTypeGpuUnavailableError = 0x4000
nvmlEventTypeGpuRecoveryAction = 0x8000
nvmlEventTypeNone = 0x0

NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1

# NVML_COMPUTE_INSTANCE_* and nvmlComputeInstanceProfileInfo_v2 live with the MIG model.
globals().update(
    {k: v for k, v in vars(mock_mig).items() if k.startswith(("NVML_COMPUTE", "nvmlC"))}
)

_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId outside MIG

_ERROR_NAMES = {
    value: name
    for name, value in globals().items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}
_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_IN_USE: "In use by another client",
    NVML_ERROR_INSUFFICIENT_RESOURCES: "Ran out of critical resources, other than memory",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

# --------------------------------------------------------------------------- errors


class NVMLError(Exception):
    """Base class of NVML errors; `value` is the NVML return code.

    As in pynvml, `NVMLError(code)` returns an instance of the code's subclass
    (e.g. `NVMLError(3)` is an `NVMLError_NotSupported`).
    """

    _by_code: dict[int, type[NVMLError]] = {}  # noqa: RUF012 - filled below
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def _class_name(error_name: str) -> str:
    # NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost (pynvml's naming rule)
    words = error_name.removeprefix("NVML_ERROR_").split("_")
    return "NVMLError_" + "".join(w.capitalize() for w in words)


def _make_error_classes() -> dict[str, type[NVMLError]]:
    classes: dict[str, type[NVMLError]] = {}
    for code, name in _ERROR_NAMES.items():
        cls = type(_class_name(name), (NVMLError,), {"__module__": __name__})
        NVMLError._by_code[code] = cls
        classes[cls.__name__] = cls
    return classes


ERROR_CLASSES = _make_error_classes()
globals().update(ERROR_CLASSES)


def nvml_error(code: int) -> NVMLError:
    return NVMLError(code)


# --------------------------------------------------------------------------- structs
# Plain objects carrying the field names of pynvml's ctypes structures.


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


@dataclass
class MemoryInfo:  # c_nvmlMemory_t / c_nvmlMemory_v2_t
    total: int
    free: int
    used: int
    reserved: int = 0
    version: int = 0


@dataclass
class PciInfo:  # nvmlPciInfo_t (char arrays decoded to str, as pynvml returns them)
    busIdLegacy: str
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int
    busId: str


@dataclass
class GpuInstanceProfileInfo:  # c_nvmlGpuInstanceProfileInfo_v2_t
    version: int
    id: int
    isP2pSupported: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    copyEngineCount: int
    decoderCount: int
    encoderCount: int
    jpegCount: int
    ofaCount: int
    memorySizeMB: int
    name: str


@dataclass
class EventData:  # c_nvmlEventData_t
    device: MockDeviceHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = _NO_INSTANCE
    computeInstanceId: int = _NO_INSTANCE


class MockDeviceHandle:
    """Opaque device handle (pynvml: c_nvmlDevice_t)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<MockDeviceHandle {self.index}>"


class MockEventSet:
    """Opaque event set (pynvml: c_nvmlEventSet_t)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # device index -> event type mask
        self.freed = False


@dataclass
class _Pending:
    index: int
    event_type: int  # 0 = "GPU is lost" (the wait raises GPU_IS_LOST)
    event_data: int = 0
    gpu_instance_id: int = _NO_INSTANCE
    compute_instance_id: int = _NO_INSTANCE


_ARCH_BY_NAME = {
    "kepler": NVML_DEVICE_ARCH_KEPLER,
    "maxwell": NVML_DEVICE_ARCH_MAXWELL,
    "pascal": NVML_DEVICE_ARCH_PASCAL,
    "volta": NVML_DEVICE_ARCH_VOLTA,
    "turing": NVML_DEVICE_ARCH_TURING,
    "ampere": NVML_DEVICE_ARCH_AMPERE,
    "ada": NVML_DEVICE_ARCH_ADA,
    "hopper": NVML_DEVICE_ARCH_HOPPER,
    "blackwell": NVML_DEVICE_ARCH_BLACKWELL,
    "rubin": NVML_DEVICE_ARCH_RUBIN,
}
_BRAND_BY_NAME = {
    "nvidia": NVML_BRAND_NVIDIA,
    "tesla": NVML_BRAND_TESLA,
    "quadro": NVML_BRAND_QUADRO,
    "geforce": NVML_BRAND_GEFORCE,
    "nvidia-rtx": NVML_BRAND_NVIDIA_RTX,
}
_SUPPORTED_EVENTS = (
    nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeGpuUnavailableError
    | nvmlEventTypeGpuRecoveryAction
)

_nvml_call = nvml_call  # count the call; require nvmlInit; MigError -> NVMLError


def _slot_value(slot: str) -> int:
    value = globals().get(f"NVML_GPU_INSTANCE_PROFILE_{slot}")
    if not isinstance(value, int):
        raise ValueError(f"unknown GPU instance profile slot {slot!r}")
    return value


class MockNvml(MigFunctions):
    """A pynvml-compatible module object for one mock node.

    `driver_root`: keep MIG instances in a state file under it (shared by every
    process on that root) and write the driver's MIG capability files there.
    """

    NVMLError = NVMLError
    c_nvmlGpuInstancePlacement_t = c_nvmlGpuInstancePlacement_t
    c_nvmlGpuInstance_t = c_nvmlGpuInstance_t
    c_nvmlComputeInstance_t = c_nvmlComputeInstance_t

    def __init__(self, fleet: Fleet, node_name: str, driver_root: Path | None = None) -> None:
        self.fleet = fleet
        self.node_name = node_name
        self.gpus: list[MockGpu] = expand_fleet(fleet, node_name)
        self._by_uuid = {g.uuid: g for g in self.gpus}
        self._handles = [MockDeviceHandle(g.index) for g in self.gpus]
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._init_count = 0
        self._lost: set[int] = set()
        self._pending: list[_Pending] = []
        self.calls: collections.Counter[str] = collections.Counter()
        self._init_mig(None if driver_root is None else Path(driver_root))

    def __getattr__(self, name: str) -> Any:
        # Constants and error classes, like `pynvml.NVML_ERROR_NOT_SUPPORTED`.
        if name in ERROR_CLASSES:
            return ERROR_CLASSES[name]
        value = globals().get(name)
        if isinstance(value, int) and (name.startswith(("NVML_", "nvmlEvent", "nvml"))):
            return value
        raise AttributeError(name)

    # ------------------------------------------------------------ mock controls

    def mock_gpu(self, uuid: str) -> MockGpu:
        try:
            return self._by_uuid[uuid]
        except KeyError:
            raise KeyError(f"no mock GPU with UUID {uuid}") from None

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
                    _Pending(gpu.index, nvmlEventTypeXidCriticalError, event.xid, gi, ci)
                )
            elif event.kind == "ecc-dbe":
                self._pending.append(_Pending(gpu.index, nvmlEventTypeDoubleBitEccError))
            elif event.kind == "gpu-lost":
                self._lost.add(gpu.index)
                self._pending.append(_Pending(gpu.index, 0))
            elif event.kind == "recovered":
                self._lost.discard(gpu.index)
                self._pending = [p for p in self._pending if p.index != gpu.index]
                self._pending.append(
                    _Pending(
                        gpu.index, nvmlEventTypeGpuRecoveryAction, NVML_GPU_RECOVERY_ACTION_NONE
                    )
                )
            else:
                raise ValueError(f"unknown health event kind {event.kind!r}")
            self._cond.notify_all()

    @staticmethod
    def _instance_ids(gpu: MockGpu, event: HealthEvent) -> tuple[int, int]:
        gi, ci = event.gpu_instance_id, event.compute_instance_id
        if gi is None and ci is None:
            return _NO_INSTANCE, _NO_INSTANCE
        if event.kind != "xid":
            raise ValueError(f"NVML attributes only Xid events to a MIG instance, not {event.kind}")
        if not gpu.mig_enabled:
            raise ValueError(f"GPU {gpu.uuid} is not in MIG mode: no event has a GPU instance")
        if gi is None:
            raise ValueError("a compute instance ID needs its GPU instance ID")
        for value in (gi, ci):
            if value is not None and not 0 <= value < _NO_INSTANCE:
                raise ValueError(f"instance ID {value} is out of range")
        return gi, _NO_INSTANCE if ci is None else ci

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

    # ------------------------------------------------------------ helpers

    def _gpu(self, handle: Any) -> MockGpu:
        if not isinstance(handle, MockDeviceHandle) or not 0 <= handle.index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            if handle.index in self._lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return self.gpus[handle.index]

    def _target(self, handle: Any) -> tuple[MockGpu, mock_mig.MigDevice | None]:
        """The GPU behind a device handle or a MIG device handle, and the MIG device."""
        if self._is_mig_handle(handle):
            mig = self._mig_device(handle)
            return mig.gpu, mig
        return self._gpu(handle), None

    def _not_mig(self, handle: Any) -> MockGpu:
        """The GPU of a device handle; NOT_SUPPORTED for a (valid) MIG device handle."""
        if self._is_mig_handle(handle):
            self._mig_device(handle)
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(handle)

    @staticmethod
    def _mig_profile(gpu: MockGpu, slot: int) -> MigProfileSpec:
        if gpu.profile.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= slot < NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for p in gpu.profile.mig.profiles:
            if _slot_value(p.slot) == slot:
                return p
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    # ------------------------------------------------------------ init / system

    @_nvml_call
    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            self._init_count += 1

    @_nvml_call
    def nvmlInit(self) -> None:
        with self._lock:
            self._init_count += 1

    @_nvml_call
    def nvmlShutdown(self) -> None:
        with self._lock:
            self._init_count -= 1

    @_nvml_call
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.fleet.resolved_driver_version

    @_nvml_call
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        major, minor = self.fleet.resolved_cuda_driver_version.split(".")
        return int(major) * 1000 + int(minor) * 10

    # ------------------------------------------------------------ devices

    @_nvml_call
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    @_nvml_call
    def nvmlDeviceGetHandleByIndex(self, index: int) -> MockDeviceHandle:
        if not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    @_nvml_call
    def nvmlDeviceGetHandleByUUID(
        self, uuid: str | bytes
    ) -> MockDeviceHandle | MockMigDeviceHandle:
        key = uuid.decode() if isinstance(uuid, bytes) else uuid
        if key.startswith("MIG-") and (mig := self._mig_handle_by_uuid(key)) is not None:
            return mig
        gpu = self._by_uuid.get(key)
        if gpu is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        with self._lock:
            if gpu.index in self._lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return self._handles[gpu.index]

    @_nvml_call
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._not_mig(handle).minor  # no /dev/nvidiaN of its own

    @_nvml_call
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, mig = self._target(handle)
        return mig.uuid if mig else gpu.uuid

    @_nvml_call
    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu, mig = self._target(handle)
        return f"{gpu.profile.productName} MIG {mig.name}" if mig else gpu.profile.productName

    @_nvml_call
    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        brand = self._target(handle)[0].profile.brand
        if brand is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _BRAND_BY_NAME.get(brand, NVML_BRAND_UNKNOWN)

    @_nvml_call
    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        arch = self._target(device)[0].profile.architecture
        if arch is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _ARCH_BY_NAME.get(arch, NVML_DEVICE_ARCH_UNKNOWN)

    @_nvml_call
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        cc = self._target(handle)[0].profile.cudaComputeCapability
        if cc is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        major, minor = cc.split(".")
        return (int(major), int(minor))

    @_nvml_call
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> MemoryInfo:
        gpu, mig = self._target(handle)
        total = (mig.profile if mig else gpu.profile).memoryMiB * 1024 * 1024
        if mig:
            return MemoryInfo(total, total, 0, version=version or 0)
        if version:
            reserved = 512 * 1024 * 1024
            return MemoryInfo(total, total - reserved, 0, reserved=reserved, version=version)
        return MemoryInfo(total=total, free=total, used=0)

    @_nvml_call
    def nvmlDeviceGetPciInfo(self, handle: Any) -> PciInfo:
        gpu = self._target(handle)[0]
        return PciInfo(
            busIdLegacy=f"{gpu.pci_domain:04X}:{gpu.pci_bus:02X}:00.0",
            domain=gpu.pci_domain,
            bus=gpu.pci_bus,
            device=0,
            pciDeviceId=gpu.profile.pciDeviceId,
            pciSubSystemId=0x16A110DE,
            busId=gpu.pci_bus_id,
        )

    @_nvml_call
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._not_mig(device)
        if not gpu.profile.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @_nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Any, profile: int, version: int = 2
    ) -> GpuInstanceProfileInfo:
        if version not in (1, 2):
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        p = self._mig_profile(self._gpu(device), profile)
        return GpuInstanceProfileInfo(
            version=nvmlGpuInstanceProfileInfo_v2 if version == 2 else 0,
            id=p.id,
            isP2pSupported=0,
            sliceCount=p.sliceCount,
            instanceCount=p.instanceCount,
            multiprocessorCount=p.multiprocessors,
            copyEngineCount=p.copyEngines,
            decoderCount=p.decoders,
            encoderCount=p.encoders,
            jpegCount=p.jpegEngines,
            ofaCount=p.ofaEngines,
            memorySizeMB=p.memoryMiB,
            name=f"MIG {p.name}" if version == 2 else "",
        )

    @_nvml_call
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        gpu = self._gpu(device)
        if gpu.profile.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        matches = [p for p in gpu.profile.mig.profiles if p.id == profileId]
        if not matches:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        placements = matches[0].placements
        if placementsRef is None:
            set_out_uint(countRef, len(placements))
            return NVML_SUCCESS
        if get_out_uint(countRef) < len(placements):
            set_out_uint(countRef, len(placements))
            raise NVMLError(NVML_ERROR_INSUFFICIENT_SIZE)
        for i, (start, size) in enumerate(placements):
            placementsRef[i].start = start
            placementsRef[i].size = size
        set_out_uint(countRef, len(placements))
        return NVML_SUCCESS

    # ------------------------------------------------------------ events

    @_nvml_call
    def nvmlEventSetCreate(self) -> MockEventSet:
        return MockEventSet()

    @_nvml_call
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._not_mig(handle)  # no per-MIG-device events (nvml.h)
        return _SUPPORTED_EVENTS

    @_nvml_call
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._not_mig(handle)
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if eventTypes & ~_SUPPORTED_EVENTS:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            eventSet.registered[gpu.index] = eventSet.registered.get(gpu.index, 0) | eventTypes

    def _take(self, event_set: MockEventSet) -> _Pending | None:
        for i, p in enumerate(self._pending):
            mask = event_set.registered.get(p.index)
            if mask is None:
                continue
            if p.event_type == 0 or p.event_type & mask:
                del self._pending[i]
                return p
        return None

    @_nvml_call
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

    @_nvml_call
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        eventSet.freed = True
