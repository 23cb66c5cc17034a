"""What a recorded GPU-instance id holds now, and destroying a GPU instance
(docs/mig.md, "Crash safety" and "A GPU instance without a compute instance").

A GPU instance's id follows its placement, so the id a claim recorded may hold a device
someone else made there since; only the recorded profile, placement and MIG UUID at
the recorded ids say it is still the claim's. Used by `MigManager.destroy`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from driver.nvml.calls import is_nvml_error
from driver.nvml.mig.mig_listing import compute_instances, is_mig_device

log = logging.getLogger("driver.nvml.mig.mig_manager")


@dataclass(frozen=True)
class RecordedInstance:
    """What the caller recorded of a GPU instance it created: checked before the id
    is trusted at destroy."""

    profile_id: int
    placement: tuple[int, int]  # (start, size) in memory slices
    ci_id: int | None  # its compute instance, if the record has it
    uuid: str | None = None  # its MIG device's UUID, if the record has it


class Found(enum.Enum):
    """What a recorded GPU-instance id holds now."""

    RECORDED = enum.auto()  # the recorded device (or a record with nothing more to check)
    LEFT = enum.auto()  # a GPU instance without any compute instance: what is left of it
    OTHER = enum.auto()  # the recorded device, but another one at its ids: left alone
    REPLACED = enum.auto()  # another profile or placement: the recorded instance is gone


def found_at_id(nvml: Any, handle: Any, gi: Any, what: str, recorded: RecordedInstance) -> Found:
    """What the GPU instance `gi`, at the recorded id, is to the record."""
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    found = (int(info.profileId), (int(info.placement.start), int(info.placement.size)))
    if found != (recorded.profile_id, recorded.placement):
        log.warning(
            "%s is profile %d at placement %s, not the recorded profile %d at %s: left alone",
            what,
            found[0],
            found[1],
            recorded.profile_id,
            recorded.placement,
        )
        return Found.REPLACED
    if recorded.uuid is None or recorded.ci_id is None:
        return Found.RECORDED
    if is_mig_device(nvml, handle, int(info.id), recorded.ci_id, recorded.uuid):
        return Found.RECORDED
    if not compute_instances(nvml, gi):
        # No MIG device runs on a GPU instance without compute instances: taken for
        # what is left of the recorded device (a teardown killed between its two
        # destroys, or its compute instance destroyed by hand). Kept, it holds the
        # placement. It may also be an administrator's device in the making, whose
        # compute instance is not there yet (docs/mig.md, "Crash safety").
        log.warning(
            "%s has lost the recorded MIG device %s and holds no compute instance: "
            "destroying what is left of it",
            what,
            recorded.uuid,
        )
        return Found.LEFT
    log.warning(
        "%s / compute instance %d is no longer the recorded MIG device %s (created again "
        "by someone else): left alone",
        what,
        recorded.ci_id,
        recorded.uuid,
    )
    return Found.OTHER


def destroy_left(nvml: Any, gi: Any, what: str) -> bool:
    """Destroy the GPU instance found without compute instances, and no compute
    instance: False, and nothing destroyed, if one was created in it since the check
    (NVML refuses the destroy, IN_USE), as an administrator making a MIG device there
    does. IN_USE with none in it (in use by another client): tried once more. Raises
    NVMLError."""
    try:
        nvml.nvmlGpuInstanceDestroy(gi)
        return True
    except nvml.NVMLError as err:
        if not is_nvml_error(nvml, err, "NVML_ERROR_IN_USE"):
            raise
    if compute_instances(nvml, gi):
        log.warning(
            "%s was found without a compute instance and holds one now (a MIG device "
            "someone is making there): not the recorded device, left alone",
            what,
        )
        return False
    nvml.nvmlGpuInstanceDestroy(gi)
    return True


def destroy_instance(nvml: Any, gi: Any, ci_id: int | None) -> None:
    """The compute instance by its id, then the GPU instance; if NVML says the GPU
    instance is still in use (a compute instance the id did not name, or none was
    recorded), every compute instance it holds, then the GPU instance again. Only for
    a GPU instance that is the caller's: the recorded device's (its UUID at its ids),
    one a create just made, or one a record without a UUID names (a GPU instance a
    failed create left, an intent's attempt)."""
    if ci_id is not None:
        try:
            nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
        except nvml.NVMLError as err:
            if not is_nvml_error(nvml, err, "NVML_ERROR_NOT_FOUND"):
                raise
        try:
            nvml.nvmlGpuInstanceDestroy(gi)
            return
        except nvml.NVMLError as err:
            if not is_nvml_error(nvml, err, "NVML_ERROR_IN_USE"):
                raise
    for ci in compute_instances(nvml, gi):
        nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
