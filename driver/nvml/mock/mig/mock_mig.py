"""The mock NVML's MIG lifecycle: GPU instances, compute instances and MIG devices.

`MigFunctions` is mixed into `MockNvml`; its `nvml*` methods carry pynvml's names and
signatures and raise NVML's codes. Instances live in a `MigStore`: in memory, or, with
a driver root, in `<root>/run/nvidia-mock/mig-state.json` (`driver.nvml.mock.mig.mig_store`:
changed under `fcntl.flock` on `mig-state.lock` and written atomically, read without
the lock), so a restarted plugin or a CLI sees the instances a plugin created, as on
a real GPU. `mock_reboot()` drops the
dynamic instances and re-creates the fleet's `migInstances` (GPU instances do not
survive a reboot; mig-parted re-creates them at boot). With a driver root the driver's
capability files follow the instances (see `mig_minor`).

NVML behaviour modelled, and where it comes from:
- A GPU instance's ID is RM's swizzle ID of its memory span: whole GPU 0, halves 1-2,
  quarters 3-6, eighths 7-14 (kmigmgrSwizzIdToSpan_GA100, NVIDIA/open-gpu-kernel-
  modules); `nvidia-smi mig -lgi` shows 1g.5gb at 6:1 as GI 13, 3g.20gb at 0:4 as GI 1.
- nvmlDeviceCreateGpuInstance (no placement) takes the best fit: the free placement
  whose enclosing spans (itself, its buddy pair, ... the GPU) have the fewest free
  usable slices (slice 7 has no compute slice), lowest start on ties. RM decides this in
  GSP firmware; the rule reproduces published transcripts (A100: seven `-cgi 19` give
  GI 13, 11, 12, 7, 8, 9, 10; two `-cgi 9` give GI 2, then 1).
- A compute instance takes the lowest free ID of 0-7 (kmigmgrCreateComputeInstances)
  and the lowest free aligned compute-slice placement; CI profiles are the c-slice
  ones (c = 1, 2, 3, 4 below the GI's size) plus the one covering the GI.
- MIG UUIDs are `MIG-` + a name-based SHA-1 (version 5) UUID, like RM's
  nvGenerateSmcUuid, here over (GPU UUID, the compute instance's serial): new for
  every device created, also one created again at the same placement (which gets
  the same GI and CI ids), deterministic for a node's sequence of creates.
- `device` in nvmlGpuInstanceInfo_t / nvmlComputeInstanceInfo_t is the *parent* GPU
  handle (nvml.h: "Parent device"); a MIG device handle comes from
  nvmlDeviceGetMigDeviceHandleByIndex, whose indices are dense, ordered by (GI, CI).
- Occupied/overlapping placement or no capacity: INSUFFICIENT_RESOURCES; a placement
  the profile does not have: INVALID_ARGUMENT; MIG mode off: NOT_SUPPORTED; unknown
  ID: NOT_FOUND; destroying a GI with compute instances: IN_USE; a handle whose
  instance was destroyed: INVALID_ARGUMENT; a non-MIG handle where a MIG device handle
  is required: INVALID_ARGUMENT.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from driver.nvml.mock.fleet import MigProfileSpec, MigSpec, MockGpu
from driver.nvml.mock.latency import latency_from_env
from driver.nvml.mock.mig.mig_state import (
    CiProfile,
    CiRecord,
    ComputeInstanceInfo,
    ComputeInstanceProfileInfo,
    GiRecord,
    GpuInstanceInfo,
    MigDevice,
    MockComputeInstance,
    MockGpuInstance,
    MockMigDeviceHandle,
    Placement,
    State,
    ci_profiles,
    create_ci,
    create_gi,
    mig_uuid,
)
from driver.nvml.mock.mig.mig_store import MigStore
from driver.nvml.mock.mock_api import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    MigError,
    nvml_call,
    nvmlComputeInstanceProfileInfo_v2,
    ref_target,
    set_out_uint,
)

_CI_COUNT = NVML_COMPUTE_INSTANCE_PROFILE_COUNT


_H = TypeVar("_H")
_CiHandle = TypeVar("_CiHandle", MockComputeInstance, MockMigDeviceHandle)


def _find_gi(st: State, gpu: MockGpu, gi_id: Any) -> GiRecord | None:
    return next((gi for gi in st.gpus.get(gpu.uuid, []) if gi.id == gi_id), None)


class MigFunctions:
    """The MIG part of `MockNvml`: pynvml's MIG functions over a `MigStore`."""

    NVMLError: Any
    gpus: list[MockGpu]
    _handles: Sequence[Any]

    if TYPE_CHECKING:

        def _gpu(self, handle: Any) -> MockGpu: ...

    def _init_mig(self, driver_root: Path | None) -> None:
        self.mig_store = MigStore(self.gpus, driver_root)
        # Seconds a GPU-instance create or destroy takes (driver/nvml/mock/latency.py),
        # spent before the instance changes and outside every lock, as a GPU does.
        self.mig_latency = latency_from_env()
        self._interned: dict[object, object] = {}  # one handle object per instance
        self._by_address: dict[int, object] = {}  # id(handle) -> handle, for ctypes arrays
        if driver_root is not None:
            with self.mig_store.open():
                pass  # the node is up: state file and capability files exist from now on

    def mock_reboot(self) -> None:
        """Reboot the node: dynamic MIG instances vanish, the fleet's `migInstances` return."""
        with self.mig_store.open() as st:
            fresh = self.mig_store.boot(st.serial)
            st.gpus, st.serial = fresh.gpus, fresh.serial

    # ------------------------------------------------------------ helpers

    def _intern(self, handle: _H) -> _H:
        handle = cast(_H, self._interned.setdefault(handle, handle))
        self._by_address[id(handle)] = handle
        return handle

    def _handle(self, handle: Any, cls: type[_H]) -> _H:
        if isinstance(handle, ctypes._Pointer):  # an element of a ctypes array we filled
            handle = self._by_address.get(ctypes.cast(handle, ctypes.c_void_p).value or 0)
        if not isinstance(handle, cls):
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def _is_mig_handle(self, handle: Any) -> bool:
        try:
            self._handle(handle, MockMigDeviceHandle)
        except MigError:
            return False
        return True

    def _mig_gpu(self, device: Any) -> MockGpu:
        gpu = self._mig_capable_gpu(device)
        if not gpu.mig_enabled:
            raise MigError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_capable_gpu(self, device: Any) -> MockGpu:
        """A GPU that can run MIG, in MIG mode or not. Lookups of GPU instances and MIG
        devices on one with MIG mode off find none (a real H200 answered an empty list
        and NOT_FOUND), where creating one is NOT_SUPPORTED."""
        gpu = self._gpu(device)
        if gpu.profile.mig is None:
            raise MigError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @staticmethod
    def _gi_profile(gpu: MockGpu, profile_id: Any) -> MigProfileSpec:
        profile = cast(MigSpec, gpu.profile.mig).by_id(profile_id)
        if profile is None:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        return profile

    @staticmethod
    def _ci_profile(gpu: MockGpu, gi: GiRecord, profile_id: Any) -> CiProfile:
        if not isinstance(profile_id, int) or not 0 <= profile_id < _CI_COUNT:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        mig = cast(MigSpec, gpu.profile.mig)
        found = ci_profiles(mig, cast(MigProfileSpec, mig.by_id(gi.profile))).get(profile_id)
        if found is None:
            raise MigError(NVML_ERROR_NOT_SUPPORTED)
        return found

    def _gi_of(self, st: State, handle: Any) -> tuple[MockGpu, GiRecord]:
        h = self._handle(handle, MockGpuInstance)
        gpu = self._gpu(self._handles[h.gpu])
        gi = _find_gi(st, gpu, h.id)
        if gi is None or gi.serial != h.serial:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gi

    def _ci_of(
        self, st: State, handle: Any, cls: type[_CiHandle]
    ) -> tuple[MockGpu, GiRecord, CiRecord]:
        h = self._handle(handle, cls)
        gpu = self._gpu(self._handles[h.gpu])
        gi = _find_gi(st, gpu, h.gi)
        ci = next((c for c in gi.cis if c.serial == h.serial), None) if gi else None
        if gi is None or ci is None:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gi, ci

    def _gi_handle(self, gpu: MockGpu, gi: GiRecord) -> MockGpuInstance:
        return self._intern(MockGpuInstance(gpu.index, gi.id, gi.serial))

    def _ci_handle(
        self, cls: type[_CiHandle], gpu: MockGpu, gi: GiRecord, ci: CiRecord
    ) -> _CiHandle:
        return self._intern(cls(gpu.index, gi.id, ci.id, ci.serial))

    def _fill(self, ref: Any, handles: list[Any], count_ref: Any) -> None:
        """Write handles into a list or a ctypes array of handles, and their count."""
        if ref is None or count_ref is None:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        set_out_uint(count_ref, len(handles))
        if len(handles) > len(ref):
            raise MigError(NVML_ERROR_INSUFFICIENT_SIZE)
        for i, h in enumerate(handles):
            array = isinstance(ref, ctypes.Array)
            ref[i] = ctypes.cast(ctypes.c_void_p(id(h)), ref._type_) if array else h

    def _mig_device(self, handle: Any) -> MigDevice:
        st = self.mig_store.read()
        gpu, gi, ci = self._ci_of(st, handle, MockMigDeviceHandle)
        mig = cast(MigSpec, gpu.profile.mig)
        profile = cast(MigProfileSpec, mig.by_id(gi.profile))
        name = ci_profiles(mig, profile)[ci.profile].name
        return MigDevice(gpu, mig_uuid(gpu.uuid, ci), profile, name)

    def _mig_handle_by_uuid(self, uuid: str) -> MockMigDeviceHandle | None:
        """`MIG-<uuid>`, or the legacy `MIG-GPU-<uuid>/<gi>/<ci>`, to its handle."""
        st = self.mig_store.read()
        for gpu in self.gpus:
            for gi in st.gpus.get(gpu.uuid, []):
                for ci in gi.cis:
                    names = (
                        mig_uuid(gpu.uuid, ci),
                        f"MIG-{gpu.uuid}/{gi.id}/{ci.id}",
                    )
                    if uuid in names:
                        return self._ci_handle(MockMigDeviceHandle, gpu, gi, ci)
        return None

    # ------------------------------------------------------------ GPU instances

    def _create_gpu_instance(
        self, gpu: MockGpu, profile_id: Any, at: tuple[int, int] | None
    ) -> MockGpuInstance:
        profile = self._gi_profile(gpu, profile_id)
        time.sleep(self.mig_latency)
        with self.mig_store.open() as st:
            gi = create_gi(st, gpu, profile, at)
        return self._gi_handle(gpu, gi)

    @nvml_call
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: Any, profileId: int, placement: Any
    ) -> MockGpuInstance:
        gpu = self._mig_gpu(device)
        target = ref_target(placement)
        try:
            at = (int(target.start), int(target.size))
        except (AttributeError, TypeError, ValueError):
            raise MigError(NVML_ERROR_INVALID_ARGUMENT) from None
        return self._create_gpu_instance(gpu, profileId, at)

    @nvml_call
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> MockGpuInstance:
        return self._create_gpu_instance(self._mig_gpu(device), profileId, None)

    @nvml_call
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> MockGpuInstance:
        gpu = self._mig_capable_gpu(device)
        st = self.mig_store.read()
        gi = _find_gi(st, gpu, gpuInstanceId)
        if gi is None:
            raise MigError(NVML_ERROR_NOT_FOUND)
        return self._gi_handle(gpu, gi)

    @nvml_call
    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        gpu = self._mig_capable_gpu(device)
        self._gi_profile(gpu, profileId)
        st = self.mig_store.read()
        gis = [gi for gi in st.gpus.get(gpu.uuid, []) if gi.profile == profileId]
        self._fill(gpuInstancesRef, [self._gi_handle(gpu, gi) for gi in gis], countRef)
        return NVML_SUCCESS

    @nvml_call
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> GpuInstanceInfo:
        st = self.mig_store.read()
        gpu, gi = self._gi_of(st, gpuInstance)
        placement = Placement(gi.start, gi.size)
        return GpuInstanceInfo(self._handles[gpu.index], gi.id, gi.profile, placement)

    @nvml_call
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        time.sleep(self.mig_latency)
        with self.mig_store.open() as st:
            gpu, gi = self._gi_of(st, gpuInstance)
            if gi.cis:
                raise MigError(NVML_ERROR_IN_USE)
            st.gpus[gpu.uuid].remove(gi)
        return NVML_SUCCESS

    # ------------------------------------------------------------ compute instances

    @nvml_call
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> ComputeInstanceProfileInfo:
        if version not in (1, 2):
            raise MigError(NVML_ERROR_FUNCTION_NOT_FOUND)
        st = self.mig_store.read()
        gpu, gi = self._gi_of(st, device)
        if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        ci = self._ci_profile(gpu, gi, profile)
        g = cast(MigProfileSpec, cast(MigSpec, gpu.profile.mig).by_id(gi.profile))
        return ComputeInstanceProfileInfo(
            version=nvmlComputeInstanceProfileInfo_v2 if version == 2 else 0,
            id=ci.id,
            sliceCount=ci.slices,
            instanceCount=len(ci.starts),
            multiprocessorCount=ci.multiprocessors,
            sharedCopyEngineCount=g.copyEngines,
            sharedDecoderCount=g.decoders,
            sharedEncoderCount=g.encoders,
            sharedJpegCount=g.jpegEngines,
            sharedOfaCount=g.ofaEngines,
            name=f"MIG {ci.name}" if version == 2 else "",
        )

    @nvml_call
    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: Any, profileId: int
    ) -> MockComputeInstance:
        with self.mig_store.open() as st:
            gpu, gi = self._gi_of(st, gpuInstance)
            ci = create_ci(st, gi, self._ci_profile(gpu, gi, profileId))
        return self._ci_handle(MockComputeInstance, gpu, gi, ci)

    @nvml_call
    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: Any, computeInstanceId: int
    ) -> MockComputeInstance:
        st = self.mig_store.read()
        gpu, gi = self._gi_of(st, gpuInstance)
        ci = next((c for c in gi.cis if c.id == computeInstanceId), None)
        if ci is None:
            raise MigError(NVML_ERROR_NOT_FOUND)
        return self._ci_handle(MockComputeInstance, gpu, gi, ci)

    @nvml_call
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        st = self.mig_store.read()
        gpu, gi = self._gi_of(st, gpuInstance)
        self._ci_profile(gpu, gi, profileId)
        cis = [self._ci_handle(MockComputeInstance, gpu, gi, c) for c in gi.cis]
        self._fill(
            computeInstancesRef,
            [h for h, c in zip(cis, gi.cis, strict=True) if c.profile == profileId],
            countRef,
        )
        return NVML_SUCCESS

    @nvml_call
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> ComputeInstanceInfo:
        st = self.mig_store.read()
        gpu, gi, ci = self._ci_of(st, computeInstance, MockComputeInstance)
        return ComputeInstanceInfo(
            device=self._handles[gpu.index],
            gpuInstance=self._gi_handle(gpu, gi),
            id=ci.id,
            profileId=ci.profile,
            placement=Placement(ci.start, ci.size),
        )

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> ComputeInstanceInfo:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    @nvml_call
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        with self.mig_store.open() as st:
            _, gi, ci = self._ci_of(st, computeInstance, MockComputeInstance)
            gi.cis.remove(ci)
        return NVML_SUCCESS

    # ------------------------------------------------------------ MIG device handles

    @nvml_call
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu(device)
        mig = gpu.profile.mig
        return mig.compute_slices if mig is not None and gpu.mig_enabled else 0

    @nvml_call
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> MockMigDeviceHandle:
        gpu = self._mig_capable_gpu(device)
        if (
            not isinstance(index, int)
            or not 0 <= index < cast(MigSpec, gpu.profile.mig).compute_slices
        ):
            raise MigError(NVML_ERROR_INVALID_ARGUMENT)
        st = self.mig_store.read()
        devices = [(gi, ci) for gi in st.gpus.get(gpu.uuid, []) for ci in gi.cis]
        if index >= len(devices):
            raise MigError(NVML_ERROR_NOT_FOUND)
        return self._ci_handle(MockMigDeviceHandle, gpu, *devices[index])

    @nvml_call
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> ctypes.c_uint:
        if self._is_mig_handle(device):
            self._mig_device(device)  # a destroyed MIG device's handle is invalid
            return ctypes.c_uint(1)
        self._gpu(device)
        return ctypes.c_uint(0)

    @nvml_call
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        return self._handles[self._mig_device(migDevice).gpu.index]

    @nvml_call
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        st = self.mig_store.read()
        return self._ci_of(st, device, MockMigDeviceHandle)[1].id

    @nvml_call
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        st = self.mig_store.read()
        return self._ci_of(st, device, MockMigDeviceHandle)[2].id
