"""The pynvml surface the mock NVML exposes: NVML's constants, error classes and the
return structures, under pynvml's names and with NVML's values (nvml.h, nvidia-ml-py
13.x). `MockNvml` (driver/nvml/mock/nvml.py) serves them as module attributes, as pynvml
does; tests import them from here.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

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

NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1  # support removed (nvml.h)
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
NVML_COMPUTEMODE_COUNT = 4

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
NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX = 0x11
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12


def gpu_instance_profile_slots(driver_version: str) -> int:
    """How many GPU-instance profile slots a driver knows (a slot past them is
    INVALID_ARGUMENT). 3_SLICE_GFX came after R590 (NVML's change log); an R580 H200
    answered INVALID_ARGUMENT for it."""
    major = driver_version.split(".")[0]
    if major.isascii() and major.isdigit() and int(major) <= 590:
        return NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX
    return NVML_GPU_INSTANCE_PROFILE_COUNT


nvmlGpuInstanceProfileInfo_v2 = 0x02000098
nvmlMemory_v2 = 0x02000028

nvmlEventTypeSingleBitEccError = 0x0001
nvmlEventTypeDoubleBitEccError = 0x0002
nvmlEventTypePState = 0x0004
nvmlEventTypeXidCriticalError = 0x0008
nvmlEventTypeClock = 0x0010
nvmlEventTypePowerSourceChange = 0x0080
nvmlEventMigConfigChange = 0x0100
nvmlEventTypeSingleBitEccErrorStorm = 0x0200
nvmlEventTypeDramRetirementEvent = 0x0400
nvmlEventTypeDramRetirementFailure = 0x0800
nvmlEventTypeNonFatalPoisonError = 0x1000
nvmlEventTypeFatalPoisonError = 0x2000
nvmlEventTypeGpuUnavailableError = 0x4000
nvmlEventTypeGpuRecoveryAction = 0x8000
nvmlEventTypeNone = 0x0
nvmlEventTypeAll = (
    nvmlEventTypeNone
    | nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeClock
    | nvmlEventTypePowerSourceChange
    | nvmlEventTypeXidCriticalError
    | nvmlEventMigConfigChange
    | nvmlEventTypeSingleBitEccErrorStorm
    | nvmlEventTypeDramRetirementEvent
    | nvmlEventTypeDramRetirementFailure
    | nvmlEventTypeNonFatalPoisonError
    | nvmlEventTypeFatalPoisonError
    | nvmlEventTypeGpuUnavailableError
    | nvmlEventTypeGpuRecoveryAction
)

NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4
NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN = 5
NVML_GPU_RECOVERY_ACTION_BUS_RESET = 6
NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT = 7

NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_VALUE_TYPE_UNSIGNED_INT = 1

NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL = 0x8
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT = 0x1
NVML_COMPUTE_INSTANCE_ID_ANY = 0xFFFFFFFF
nvmlComputeInstanceProfileInfo_v2 = 0x02000088

NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId outside MIG

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


class c_nvmlValue_t(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):
    """One entry of `nvmlDeviceGetFieldValues`: the field asked for and NVML's answer
    for it (`nvmlReturn`, then `valueType` and `value` when it is NVML_SUCCESS)."""

    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


@dataclass
class EventData:  # c_nvmlEventData_t
    device: MockDeviceHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = NO_INSTANCE
    computeInstanceId: int = NO_INSTANCE


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


class MigError(Exception):
    """An NVML return code raised by the MIG model (the mock raises it as `NVMLError`)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# --------------------------------------------------------------------------- calls

_F = TypeVar("_F", bound=Callable[..., Any])


def nvml_call(fn: _F) -> _F:
    """Count the call; require nvmlInit (except for init itself); MigError -> NVMLError."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls[name] += 1
            if name not in ("nvmlInit", "nvmlInitWithFlags") and self._init_count == 0:
                raise self.NVMLError(NVML_ERROR_UNINITIALIZED)
        try:
            return fn(self, *args, **kwargs)
        except MigError as err:
            raise self.NVMLError(err.code) from None

    return cast(_F, wrapper)


def ref_target(ref: Any) -> Any:
    """What `byref(x)` / `pointer(x)` (or a plain object) refers to."""
    target = getattr(ref, "_obj", None)  # ctypes.byref(...) argument
    if target is None:
        try:
            target = ref.contents  # ctypes.pointer(...)
        except (AttributeError, ValueError):
            target = ref
    return target


def set_out_uint(ref: Any, value: int) -> None:
    """Write through `byref(c_uint)` or `pointer(c_uint)`, as NVML writes its out-args."""
    ref_target(ref).value = value


def get_out_uint(ref: Any) -> int:
    return int(ref_target(ref).value)
