"""MockNvml: a pynvml-compatible fake NVML built from a mock fleet.

An instance stands in for the `pynvml` module: the same function names, arguments,
return shapes, constants and `NVMLError` subclasses (with NVML's numeric codes, in
`driver/nvml/mock/mock_api.py`), so
`NvmlBackend` runs unchanged on real pynvml and on the mock. Nothing here imports or
copies pynvml; names and values mirror its public API (nvidia-ml-py 13.x).

Extras for tests and demos (not part of pynvml):
- `calls`: a `collections.Counter` of every NVML function called through the mock
  (`mock.calls.total() == 0` asserts "no NVML call").
- `inject(event)`: thread-safe health injection (`driver/nvml/mock/mock_events.py`). A lost
  GPU answers GPU_IS_LOST to every query and, as nvml.h documents, makes every
  `nvmlDeviceGetHandleByUUID` answer it too (any GPU, MIG devices included) until
  it is reset; `nvmlDeviceGetHandleByIndex` fails for the lost GPU only, and a
  handle taken before the loss answers GPU_IS_LOST to every query.
- `mock_gpu(uuid)`: the fleet entry behind a GPU; `as_published(inventory)` what
  the reference `example` profile publishes instead of NVML's model.
- MIG instances (`driver/nvml/mock/mig/mock_mig.py`): GPU and compute instances and MIG device
  handles, kept in memory or, given `driver_root`, in a state file under it shared by
  every process on that root; `mock_reboot()` drops the dynamic ones.
- The recovery action per GPU (`driver/nvml/mock/mock_recovery.py`): set by the faults
  that need a reset and by `set_recovery_action(uuid, action)`, read with
  `nvmlDeviceGetFieldValues`, cleared by a reset.
- Compute processes (`driver/nvml/mock/mock_processes.py`): `start_process(uuid, kind)`
  and `end_process(pid)`, listed by `nvmlDeviceGetComputeRunningProcesses` and
  `nvmlDeviceGetMPSComputeRunningProcesses` as NVML lists them, outside MPS or not.
- Per-cgroup memory limits (`driver/nvml/mock/mock_memory_limits.py`): the driver version
  of the fleet decides whether the calls exist (R615 and later).
- Compute modes (`driver/nvml/mock/mock_compute_mode.py`): per GPU, under the driver
  root when there is one, reset by `mock_reboot()`; a mode that refuses a CUDA context
  refuses the mock's processes as CUDA would.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from driver.nvml.discovered import Inventory
from driver.nvml.mock import mock_api as mock_api
from driver.nvml.mock.fleet import Fleet, MigProfileSpec, MockGpu, expand_fleet
from driver.nvml.mock.mig import mock_mig
from driver.nvml.mock.mig.devices import ensure_proc_devices
from driver.nvml.mock.mig.mig_state import (
    MockMigDeviceHandle,
    c_nvmlComputeInstance_t,
    c_nvmlGpuInstance_t,
)
from driver.nvml.mock.mig.mock_mig import MigFunctions
from driver.nvml.mock.mock_api import (
    ERROR_CLASSES,
    NVML_BRAND_GEFORCE,
    NVML_BRAND_NVIDIA,
    NVML_BRAND_NVIDIA_RTX,
    NVML_BRAND_QUADRO,
    NVML_BRAND_TESLA,
    NVML_BRAND_UNKNOWN,
    NVML_DEVICE_ARCH_ADA,
    NVML_DEVICE_ARCH_AMPERE,
    NVML_DEVICE_ARCH_BLACKWELL,
    NVML_DEVICE_ARCH_HOPPER,
    NVML_DEVICE_ARCH_KEPLER,
    NVML_DEVICE_ARCH_MAXWELL,
    NVML_DEVICE_ARCH_PASCAL,
    NVML_DEVICE_ARCH_RUBIN,
    NVML_DEVICE_ARCH_TURING,
    NVML_DEVICE_ARCH_UNKNOWN,
    NVML_DEVICE_ARCH_VOLTA,
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    GpuInstanceProfileInfo,
    MemoryInfo,
    MockDeviceHandle,
    NVMLError,
    PciInfo,
    c_nvmlGpuInstancePlacement_t,
    get_out_uint,
    gpu_instance_profile_slots,
    nvml_call,
    nvmlGpuInstanceProfileInfo_v2,
    set_out_uint,
)
from driver.nvml.mock.mock_compute_mode import ComputeModeFunctions
from driver.nvml.mock.mock_events import EventFunctions, PendingEvent
from driver.nvml.mock.mock_memory_limits import MemoryLimitFunctions
from driver.nvml.mock.mock_processes import ProcessFunctions
from driver.nvml.mock.mock_recovery import RecoveryFunctions

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


def _slot_value(slot: str) -> int:
    value = vars(mock_api).get(f"NVML_GPU_INSTANCE_PROFILE_{slot}")
    if not isinstance(value, int):
        raise ValueError(f"unknown GPU instance profile slot {slot!r}")
    return value


class MockNvml(
    EventFunctions,
    MigFunctions,
    RecoveryFunctions,
    ProcessFunctions,
    MemoryLimitFunctions,
    ComputeModeFunctions,
):
    """A pynvml-compatible module object for one mock node.

    `driver_root`: keep MIG instances in a state file under it (shared by every
    process on that root) and write the driver's MIG capability files and the
    kernel's `proc/devices` there.
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
        self._pending: list[PendingEvent] = []
        self._recovery_actions: dict[int, int] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self._init_mig(None if driver_root is None else Path(driver_root))
        self._init_processes()
        self._init_memory_limits()
        self._init_compute_modes()
        if driver_root is not None:
            ensure_proc_devices(Path(driver_root))

    def __getattr__(self, name: str) -> Any:
        # Constants and error classes, like `pynvml.NVML_ERROR_NOT_SUPPORTED`.
        if name in ERROR_CLASSES:
            return ERROR_CLASSES[name]
        value = vars(mock_api).get(name)
        if isinstance(value, int) and (name.startswith(("NVML_", "nvmlEvent", "nvml"))):
            return value
        raise AttributeError(name)

    # ------------------------------------------------------------ mock controls

    @property
    def mock_kernel_root(self) -> Path | None:
        """The driver root the mock writes its kernel files into (`proc/devices`, MIG
        capabilities, its processes' `proc/<pid>/cgroup`); None: it writes none."""
        return self.mig_store.root

    def mock_gpu(self, uuid: str) -> MockGpu:
        try:
            return self._by_uuid[uuid]
        except KeyError:
            raise KeyError(f"no mock GPU with UUID {uuid}") from None

    def as_published(self, inventory: Inventory) -> Inventory:
        """The inventory with what a profile publishes instead of NVML's answer: the
        `example` profile publishes the reference driver's model and attribute set
        (not NVML; the backend applies it after discovery)."""
        gpus = []
        for gpu in inventory.gpus:
            profile = self.mock_gpu(gpu.uuid).profile
            if profile.referenceExample:
                gpu = replace(gpu, model=profile.productName, reference_example=True)
            gpus.append(gpu)
        return replace(inventory, gpus=tuple(gpus))

    def mock_reboot(self) -> None:
        """Reboot the node: dynamic MIG instances vanish, the fleet's `migInstances`
        return, every GPU's compute mode is DEFAULT again."""
        super().mock_reboot()
        self._reset_compute_modes()

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

    def _mig_profile(self, gpu: MockGpu, slot: int) -> MigProfileSpec:
        if gpu.profile.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= slot < gpu_instance_profile_slots(self.fleet.resolved_driver_version):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for p in gpu.profile.mig.profiles:
            if _slot_value(p.slot) == slot:
                return p
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    # ------------------------------------------------------------ init / system

    @nvml_call
    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            self._init_count += 1

    @nvml_call
    def nvmlInit(self) -> None:
        with self._lock:
            self._init_count += 1

    @nvml_call
    def nvmlShutdown(self) -> None:
        with self._lock:
            self._init_count -= 1

    @nvml_call
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.fleet.resolved_driver_version

    @nvml_call
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        major, minor = self.fleet.resolved_cuda_driver_version.split(".")
        return int(major) * 1000 + int(minor) * 10

    # ------------------------------------------------------------ devices

    @nvml_call
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    @nvml_call
    def nvmlDeviceGetHandleByIndex(self, index: int) -> MockDeviceHandle:
        if not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:  # nvml.h: GPU_IS_LOST "if the target GPU has fallen off the bus"
            if index in self._lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return self._handles[index]

    @nvml_call
    def nvmlDeviceGetHandleByUUID(
        self, uuid: str | bytes
    ) -> MockDeviceHandle | MockMigDeviceHandle:
        # nvml.h: GPU_IS_LOST "if any GPU has fallen off the bus or is otherwise
        # inaccessible" (NVML searches the GPUs), so no lookup by UUID succeeds while
        # one GPU is lost; by index only the lost GPU itself fails.
        with self._lock:
            if self._lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        key = uuid.decode() if isinstance(uuid, bytes) else uuid
        if key.startswith("MIG-") and (mig := self._mig_handle_by_uuid(key)) is not None:
            return mig
        gpu = self._by_uuid.get(key)
        if gpu is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self._handles[gpu.index]

    @nvml_call
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._not_mig(handle).minor  # no /dev/nvidiaN of its own

    @nvml_call
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, mig = self._target(handle)
        return mig.uuid if mig else gpu.uuid

    @nvml_call
    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu, mig = self._target(handle)
        return f"{gpu.profile.productName} MIG {mig.name}" if mig else gpu.profile.productName

    @nvml_call
    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        brand = self._target(handle)[0].profile.brand
        if brand is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _BRAND_BY_NAME.get(brand, NVML_BRAND_UNKNOWN)

    @nvml_call
    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        arch = self._target(device)[0].profile.architecture
        if arch is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _ARCH_BY_NAME.get(arch, NVML_DEVICE_ARCH_UNKNOWN)

    @nvml_call
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        cc = self._target(handle)[0].profile.cudaComputeCapability
        if cc is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        major, minor = cc.split(".")
        return (int(major), int(minor))

    @nvml_call
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> MemoryInfo:
        gpu, mig = self._target(handle)
        total = (mig.profile if mig else gpu.profile).memoryMiB * 1024 * 1024
        if mig:
            return MemoryInfo(total, total, 0, version=version or 0)
        if version:
            reserved = 512 * 1024 * 1024
            return MemoryInfo(total, total - reserved, 0, reserved=reserved, version=version)
        return MemoryInfo(total=total, free=total, used=0)

    @nvml_call
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

    @nvml_call
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._not_mig(device)
        if not gpu.profile.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @nvml_call
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

    @nvml_call
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
