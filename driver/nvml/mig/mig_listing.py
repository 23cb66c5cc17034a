"""Reading a GPU's MIG layout through a pynvml-compatible module: its GPU instances of
a profile, each one's compute instances and MIG device UUID, and whether a recorded
MIG UUID still names the MIG device of given ids. Read-only: `MigManager`
(driver/nvml/mig/mig_manager.py) opens the NVML session and turns NVML's errors into MigErrors.

A listing races the destroys other processes make (an unprepare, which runs outside
the node lock; a rolling update's other instance; an administrator): an instance a
listing returned may be gone when it is read, and NVML then refuses its stale handle
(`INVALID_ARGUMENT`, or `NOT_FOUND`). Reads of listed handles raise
`InstanceVanished` for those, and `retried` takes the whole listing again - a MIG
device handle's index moves too when one before it goes - a few times before it
gives up with a transient MigError.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from driver.nvml.calls import is_nvml_error, nvml_text
from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_errors import MigError, error_code

log = logging.getLogger(__name__)

LISTING_ATTEMPTS = 3
_T = TypeVar("_T")


class InstanceVanished(Exception):
    """An instance a listing returned was destroyed before it was read."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{detail} ({code})")
        self.code = code


@contextmanager
def reading_listed(nvml: Any) -> Iterator[None]:
    """Around reads of handles a listing returned: NVML's answer for a stale handle
    (the instance was destroyed since) becomes `InstanceVanished`."""
    try:
        yield
    except nvml.NVMLError as err:
        if is_nvml_error(nvml, err, "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_FOUND"):
            raise InstanceVanished(error_code(nvml, err), str(err)) from err
        raise


def retried(what: str, read: Callable[[], _T]) -> _T:
    """`read()`, taken again when an instance it listed vanished under it; after
    LISTING_ATTEMPTS a MigError that says a retry succeeds (transient)."""
    for attempt in range(1, LISTING_ATTEMPTS + 1):
        try:
            return read()
        except InstanceVanished as gone:
            log.info("%s: an instance vanished under listing %d, again: %s", what, attempt, gone)
            last = gone
    raise MigError(
        f"{what}: MIG instances were destroyed under each of {LISTING_ATTEMPTS} listings "
        f"({last}); the layout is changing, a retry succeeds once it settles",
        code=last.code,
        retryable=True,
    )


def unsupported(nvml: Any, err: BaseException) -> bool:
    """NOT_SUPPORTED or INVALID_ARGUMENT: a profile this GPU (instance) does not have."""
    return is_nvml_error(nvml, err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT")


def gpu_instances(nvml: Any, handle: Any, profile_id: int, limit: int) -> list[Any]:
    """The GPU instances of the profile (`limit`: its instanceCount, the buffer's size)."""
    if limit <= 0:
        return []
    array = (nvml.c_nvmlGpuInstance_t * limit)()
    count = ctypes.c_uint(limit)
    nvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
    return [array[i] for i in range(count.value)]


def mig_uuid_of(nvml: Any, handle: Any, gi_id: int, ci_id: int) -> str | None:
    """The UUID of the MIG device of (GPU instance, compute instance). The compute
    instance's info names its parent GPU, not the MIG device (nvml.h), so the
    parent's MIG device handles are searched."""
    for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except nvml.NVMLError as err:
            if is_nvml_error(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                continue
            raise
        with reading_listed(nvml):
            if (
                int(nvml.nvmlDeviceGetGpuInstanceId(mig)) == gi_id
                and int(nvml.nvmlDeviceGetComputeInstanceId(mig)) == ci_id
            ):
                return nvml_text(nvml.nvmlDeviceGetUUID(mig))
    return None


def is_mig_device(nvml: Any, handle: Any, gi_id: int, ci_id: int, uuid: str) -> bool:
    """Is `uuid` the MIG device of (GPU instance, compute instance) on the GPU? The
    UUID's handle (NVML takes MIG UUIDs too) and its ids: three calls. While any GPU
    of the node is lost every lookup by UUID fails (nvml.h), so the GPU's MIG devices
    are walked instead; so they are when the lookup answers NOT_FOUND, which is not
    proof that the device is gone: a "no" here makes unprepare leave the device
    running and report success, so only the device's own UUID at the ids says no."""
    try:
        mig = nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError as err:
        if not is_nvml_error(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_GPU_IS_LOST"):
            raise
        found = retried(f"MIG device {uuid}", lambda: mig_uuid_of(nvml, handle, gi_id, ci_id))
        return found == uuid
    try:
        with reading_listed(nvml):
            return (
                int(nvml.nvmlDeviceGetGpuInstanceId(mig)) == gi_id
                and int(nvml.nvmlDeviceGetComputeInstanceId(mig)) == ci_id
            )
    except InstanceVanished:
        return False  # destroyed since it was found: not the device of those ids


def describe(nvml: Any, handle: Any, gpu_uuid: str, gi: Any) -> MigInstance:
    """The listed GPU instance with its (first) compute instance and MIG device UUID;
    raises InstanceVanished if it is gone."""
    with reading_listed(nvml):
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        # The first compute instance: the driver creates one; an administrator's extra
        # ones share the GI.
        cis = compute_instances(nvml, gi)
        ci_id = int(nvml.nvmlComputeInstanceGetInfo(cis[0]).id) if cis else None
        uuid = None if ci_id is None else mig_uuid_of(nvml, handle, int(info.id), ci_id)
    return MigInstance(
        gpu_uuid=gpu_uuid,
        gi_id=int(info.id),
        profile_id=int(info.profileId),
        placement=(int(info.placement.start), int(info.placement.size)),
        ci_id=ci_id,
        uuid=uuid,
    )


def ci_profiles(nvml: Any, gi: Any) -> Iterator[Any]:
    """The compute-instance profiles the GPU instance supports (shared engines), but
    the 1-slice REV1 profile, which NVIDIA's driver skips too."""
    rev1 = getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1", None)
    for slot in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
        if slot == rev1:
            continue
        try:
            yield nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, slot, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except nvml.NVMLError as err:
            if not unsupported(nvml, err):
                raise


def compute_instances(nvml: Any, gi: Any) -> list[Any]:
    """Every compute instance of the GPU instance, of every profile."""
    found: list[Any] = []
    for info in ci_profiles(nvml, gi):
        limit = int(info.instanceCount)
        if limit <= 0:
            continue
        array = (nvml.c_nvmlComputeInstance_t * limit)()
        count = ctypes.c_uint(limit)
        nvml.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), array, ctypes.byref(count))
        found.extend(array[i] for i in range(count.value))
    return found
