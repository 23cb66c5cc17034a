"""The MIG lifecycle over a pynvml-compatible module: list, create and destroy MIG
devices (a GPU instance at a placement plus one compute instance covering it).

The calls and the error handling follow NVML (nvml.h) and what NVIDIA's DRA driver
does (docs/mig.md):

- create: `nvmlDeviceCreateGpuInstanceWithPlacement` -> `nvmlGpuInstanceGetInfo` ->
  the compute-instance profile whose slice count equals the GPU instance's ->
  `nvmlGpuInstanceCreateComputeInstance` -> `nvmlComputeInstanceGetInfo` -> the MIG
  device's UUID. A failure after the GPU instance exists destroys it again, so a
  failed create leaves nothing (or, if that destroy fails too, its error names the
  instance left, `MigError.left_gi_id`). An occupied placement is NVML's
  `INSUFFICIENT_RESOURCES` (NVML has no "already exists");
- destroy: compute instance, then GPU instance; an instance that is already gone is
  success (destroy is what unprepare and crash recovery repeat). A recorded device
  this manager destroyed, or found gone, is not looked for again: what sits at its
  ids later is someone else's (`MigManager.destroy`);
- list: every GPU instance of every profile (`nvmlDeviceGetGpuInstances`) and its
  compute instances, so a GPU instance without a compute instance (a crash between
  the two creates) is found too - enumerating MIG device handles would miss it.

A GPU is looked up by UUID; while any GPU of the node is lost that lookup answers
`GPU_IS_LOST` for every GPU (nvml.h), so the GPU is then searched by index, where
only the lost GPU itself fails: one GPU off the bus leaves the others usable. Every
NVML error of a method that opens its own session (`nvmlInit` included) is raised
as a `MigError` naming the NVML code; `gpu_gone` marks a GPU that is lost or no
longer on the node (docs/mig.md, "A lost GPU").

No MIG mode is ever changed here.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from driver.nvml.calls import is_nvml_error, nvml_text
from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_errors import MigError, mig_error
from driver.nvml.mig.mig_gone import GoneDevices
from driver.nvml.mig.mig_listing import (
    ci_profiles,
    describe,
    gpu_instances,
    mig_uuid_of,
    reading_listed,
    retried,
    unsupported,
)
from driver.nvml.mig.mig_recorded import (
    Found,
    RecordedInstance,
    destroy_instance,
    destroy_left,
    found_at_id,
)

log = logging.getLogger(__name__)

__all__ = ["MigError", "MigInstance", "MigManager", "MigTarget", "RecordedInstance"]


@dataclass(frozen=True)
class MigTarget:
    """Where to create a MIG device: parent GPU, GPU-instance profile and placement."""

    gpu_uuid: str
    profile_id: int
    placement: tuple[int, int]  # (start, size)
    slice_count: int  # compute slices of the profile: the compute instance covers them

    def describe(self) -> str:
        return f"profile {self.profile_id} at {self.placement[0]}+{self.placement[1]}"


class MigManager:
    """MIG devices of this node's GPUs. Each call opens its own NVML session (NVML
    is thread-safe and counts its initialisations). Creates and destroys on one GPU
    run one at a time; on different GPUs, and listings, side by side: the plugin
    makes them outside its node lock (driver/state/apply.py), and a create on a
    real GPU takes hundreds of milliseconds to seconds."""

    def __init__(self, module: Any) -> None:
        self._nvml = module
        self._gpu_locks: dict[str, threading.Lock] = {}
        self._gpu_locks_guard = threading.Lock()
        # GPU UUID -> {GPU-instance profile id: its instanceCount}: fixed while the
        # GPU is in MIG mode (a mode change needs a GPU reset and a plugin restart).
        self._profile_limits: dict[str, dict[int, int]] = {}
        self._gone = GoneDevices()  # recorded devices destroyed or found gone

    def _changing(self, gpu_uuid: str) -> threading.Lock:
        """The lock of the GPU's MIG layout in this process."""
        with self._gpu_locks_guard:
            return self._gpu_locks.setdefault(gpu_uuid, threading.Lock())

    # ------------------------------------------------------------ helpers

    def _fail(self, err: BaseException, what: str, *, lookup: bool = False) -> MigError:
        return mig_error(self._nvml, err, what, lookup=lookup)

    @contextmanager
    def _session(self) -> Iterator[Any]:
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise self._fail(err, "initialising NVML") from err
        try:
            yield nvml
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as err:  # the work is done (or failed) already
                log.warning("nvmlShutdown failed: %s", err)

    def _lookup(self, nvml: Any, gpu_uuid: str) -> Any:
        """The GPU's handle, or a MigError (`gpu_gone` if it is lost or not here)."""
        try:
            return self._handle(nvml, gpu_uuid)
        except nvml.NVMLError as err:
            raise self._fail(err, f"looking up GPU {gpu_uuid}", lookup=True) from err

    def _handle(self, nvml: Any, gpu_uuid: str) -> Any:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except nvml.NVMLError as err:
            # nvml.h: by UUID, GPU_IS_LOST "if any GPU has fallen off the bus"; by
            # index only "if the target GPU has": a healthy GPU is found that way.
            if not is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                raise
            lost = err
        # Not found by index: any other error of a GPU that does not answer is raised
        # (it may be this one); else the GPU is the lost one (or not on this node).
        other: BaseException | None = None
        for index in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                if nvml_text(nvml.nvmlDeviceGetUUID(handle)) == gpu_uuid:
                    return handle
            except nvml.NVMLError as err:
                log.debug("GPU at NVML index %d does not answer: %s", index, err)
                if other is None and not is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                    other = err
        raise other or lost

    # ------------------------------------------------------------ list

    def instances(self, gpu_uuid: str, *, initialised: bool = False) -> list[MigInstance]:
        """Every GPU instance on the GPU with its compute instance and MIG UUID; raises
        MigError. `initialised`: the caller holds an NVML session already and handles
        NVML's errors itself (discovery skips a GPU that is lost)."""
        if initialised:
            nvml = self._nvml
            return self._list(nvml, self._handle(nvml, gpu_uuid), gpu_uuid)
        with self._session() as nvml:
            handle = self._lookup(nvml, gpu_uuid)
            try:
                return self._list(nvml, handle, gpu_uuid)
            except nvml.NVMLError as err:
                raise self._fail(err, f"listing the MIG devices of {gpu_uuid}") from err

    def instance_ids_at(
        self, gpu_uuid: str, profile_id: int, placement: tuple[int, int]
    ) -> tuple[int, ...]:
        """The ids of the GPU instances of the profile at the placement: that
        profile's instances only, a few calls where `instances` describes every
        instance of the GPU. Raises MigError."""
        with self._session() as nvml:
            handle = self._lookup(nvml, gpu_uuid)
            what = f"listing the GPU instances of {gpu_uuid}"

            def ids_at() -> tuple[int, ...]:
                ids = []
                for gi in gpu_instances(nvml, handle, profile_id, limit):
                    with reading_listed(nvml):
                        info = nvml.nvmlGpuInstanceGetInfo(gi)
                    if (int(info.placement.start), int(info.placement.size)) == placement:
                        ids.append(int(info.id))
                return tuple(sorted(ids))

            try:
                limit = self._limits(nvml, handle, gpu_uuid).get(profile_id, 0)
                return retried(what, ids_at)
            except nvml.NVMLError as err:
                raise self._fail(err, what) from err

    def _limits(self, nvml: Any, handle: Any, gpu_uuid: str) -> dict[int, int]:
        """Profile id -> how many instances of it the GPU can hold, read once per GPU
        (NVML needs the count to size the buffer of a listing)."""
        with self._gpu_locks_guard:
            known = self._profile_limits.get(gpu_uuid)
        if known is not None:
            return known
        limits: dict[int, int] = {}
        for slot in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, slot)
            except nvml.NVMLError as err:
                if unsupported(nvml, err):
                    continue
                raise
            limits[int(info.id)] = int(info.instanceCount)
        if limits:  # none: MIG mode off (for now)
            with self._gpu_locks_guard:
                self._profile_limits[gpu_uuid] = limits
        return limits

    def _list(self, nvml: Any, handle: Any, gpu_uuid: str) -> list[MigInstance]:
        limits = self._limits(nvml, handle, gpu_uuid)

        def listing() -> list[MigInstance]:
            found = [
                describe(nvml, handle, gpu_uuid, gi)
                for profile_id, limit in limits.items()
                for gi in gpu_instances(nvml, handle, profile_id, limit)
            ]
            return sorted(found, key=lambda m: (m.placement, m.gi_id))

        return retried(f"listing the MIG devices of {gpu_uuid}", listing)

    # ------------------------------------------------------------ create

    def create(self, target: MigTarget) -> MigInstance:
        """Create the MIG device; raise MigError naming what NVML refused."""
        with self._changing(target.gpu_uuid), self._session() as nvml:
            handle = self._lookup(nvml, target.gpu_uuid)
            placement = nvml.c_nvmlGpuInstancePlacement_t()
            placement.start, placement.size = target.placement
            try:
                gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    handle, target.profile_id, ctypes.byref(placement)
                )
            except nvml.NVMLError as err:
                raise self._fail(
                    err, f"creating a GPU instance ({target.describe()}) on {target.gpu_uuid}"
                ) from err
            gi_id: int | None = None
            try:
                gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
                ci = nvml.nvmlGpuInstanceCreateComputeInstance(
                    gi, self._covering_ci_profile(nvml, gi, target.slice_count)
                )
                ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
                uuid = retried(
                    f"finding the MIG device of {target.describe()} on {target.gpu_uuid}",
                    lambda: mig_uuid_of(nvml, handle, gi_id, ci_id),
                )
                if uuid is None:
                    raise MigError(
                        f"the MIG device of GPU instance {gi_id} / compute instance {ci_id} "
                        f"on {target.gpu_uuid} has no device handle",
                        code="NVML_ERROR_NOT_FOUND",
                        retryable=True,
                    )
            except (nvml.NVMLError, MigError) as err:
                failed = (
                    err
                    if isinstance(err, MigError)
                    else self._fail(
                        err,
                        f"creating the compute instance of {target.describe()} "
                        f"on {target.gpu_uuid}",
                    )
                )
                # Destroy the half-created GPU instance; if it is still there, the
                # caller records its id (`MigError.left_gi_id`) and destroys it by that.
                try:
                    destroy_instance(nvml, gi, None)
                except nvml.NVMLError as undo_err:
                    log.error("undoing the half-created %s failed: %s", target.describe(), undo_err)
                    failed.left_gi_id = gi_id
                if failed is err:
                    raise
                raise failed from err
            return MigInstance(
                gpu_uuid=target.gpu_uuid,
                gi_id=gi_id,
                profile_id=target.profile_id,
                placement=target.placement,
                ci_id=ci_id,
                uuid=uuid,
            )

    def _covering_ci_profile(self, nvml: Any, gi: Any, slice_count: int) -> int:
        for info in ci_profiles(nvml, gi):
            if int(info.sliceCount) == slice_count:
                return int(info.id)
        raise MigError(
            f"no compute-instance profile covers {slice_count} slice(s)",
            code="NVML_ERROR_NOT_SUPPORTED",
            retryable=False,
        )

    # ------------------------------------------------------------ destroy

    def destroy(self, gpu_uuid: str, gi_id: int, recorded: RecordedInstance | None = None) -> bool:
        """Destroy the GPU instance and its compute instances, by id as NVIDIA's driver
        does. With `recorded`, only what `found_at_id` (driver/nvml/mig/mig_recorded.py)
        takes for the recorded device or what is left of it (docs/mig.md, "A GPU
        instance without a compute instance"); a recorded device this manager destroyed,
        or found gone, before is not looked for again (no NVML call): whatever sits at
        its ids now is someone else's. False when there is nothing of the record to
        destroy: no such instance, another one under the id, or MIG mode off. Raises
        MigError otherwise."""
        if recorded is not None and recorded.uuid is not None and recorded.uuid in self._gone:
            log.debug(
                "GPU instance %d on %s: the recorded MIG device %s is gone already "
                "(destroyed or found gone before): whatever is at its ids is not its",
                gi_id,
                gpu_uuid,
                recorded.uuid,
            )
            return False
        with self._changing(gpu_uuid), self._session() as nvml:
            handle = self._lookup(nvml, gpu_uuid)
            what = f"GPU instance {gi_id} on {gpu_uuid}"
            try:
                gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            except nvml.NVMLError as err:
                if is_nvml_error(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED"):
                    self._note_gone(recorded)
                    return False
                raise self._fail(err, f"looking up {what}") from err
            try:
                found = (
                    Found.RECORDED
                    if recorded is None
                    else found_at_id(nvml, handle, gi, what, recorded)
                )
                if found is Found.REPLACED:
                    self._note_gone(recorded)  # its GPU instance is gone: the id is another's
                if found in (Found.OTHER, Found.REPLACED):
                    return False
                if found is Found.LEFT:
                    if not destroy_left(nvml, gi, what):
                        self._note_gone(recorded)
                        return False
                else:
                    destroy_instance(nvml, gi, recorded.ci_id if recorded else None)
            except nvml.NVMLError as err:
                raise self._fail(err, f"destroying {what}") from err
            self._note_gone(recorded)
            return True

    def _note_gone(self, recorded: RecordedInstance | None) -> None:
        """The recorded device no longer exists: destroyed here, or its GPU instance
        gone (an id's next instance is another one)."""
        if recorded is not None and recorded.uuid is not None:
            self._gone.add(recorded.uuid)
