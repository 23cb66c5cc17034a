"""The journal's records of the hardware behind a prepared device: `HardwareRecord`
(`PreparedDevice.hardware`, key `hardware`; docs/state.md, "The journal"), set at
planning from the published device, so the double-booking guard
(driver/state/booking.py) judges a held device by what it was when it was prepared,
not by what the node publishes today; and `MigRecord` (key `mig`), the MIG device
behind a device (docs/mig.md). Both are re-exported by driver/state/journal/checkpoint.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _pair(doc: Mapping[str, Any], key: str) -> tuple[int, int] | None:
    value = doc.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)):
        raise ValueError(f"hardware.{key} must be a list of two integers")
    return (value[0], value[1])


@dataclass(frozen=True)
class HardwareRecord:
    """Which part of which GPU a device is: the whole GPU (neither `slices` nor
    `partition`), a MIG device (`slices`: (start, size) in memory slices, also for the
    full-size MIG device of a dynamic MIG GPU) or a `--gpu-partitions` partition
    (`partition`: (index, count), the index-th of count equal parts). A
    multi-allocatable device (`allowMultipleAllocations`, docs/sharing.md) may be
    shared by claims holding shares of it."""

    gpu_uuid: str
    slices: tuple[int, int] | None = None
    partition: tuple[int, int] | None = None
    multi_allocatable: bool = False

    @property
    def whole(self) -> bool:
        return self.slices is None and self.partition is None

    def overlaps(self, other: HardwareRecord) -> bool:
        """Do the two share any hardware? A whole GPU overlaps all of it; MIG devices
        overlap when their slice ranges intersect, partitions when their fractions of
        the GPU do (also across layouts: partition 1 of 2 holds partition 2 of 4); a
        MIG device and a partition cannot be compared, so they overlap."""
        if self.gpu_uuid != other.gpu_uuid:
            return False
        if self.whole or other.whole:
            return True
        if self.slices is not None and other.slices is not None:
            (a, m), (b, n) = self.slices, other.slices
            return a < b + n and b < a + m
        if self.partition is not None and other.partition is not None:
            (i, m), (j, n) = self.partition, other.partition
            # [i/m, (i+1)/m) and [j/n, (j+1)/n) intersect
            return i * n < (j + 1) * m and j * m < (i + 1) * n
        return True

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"gpu": self.gpu_uuid, "multiAllocatable": self.multi_allocatable}
        if self.slices is not None:
            doc["slices"] = list(self.slices)
        if self.partition is not None:
            doc["partition"] = list(self.partition)
        return doc

    @classmethod
    def from_json(cls, doc: object) -> HardwareRecord:
        if not isinstance(doc, Mapping):
            raise ValueError("hardware must be an object")
        gpu, multi = doc.get("gpu"), doc.get("multiAllocatable", False)
        if not isinstance(gpu, str) or not gpu:
            raise ValueError("hardware.gpu must be a GPU UUID")
        if not isinstance(multi, bool):
            raise ValueError("hardware.multiAllocatable must be a boolean")
        slices, partition = _pair(doc, "slices"), _pair(doc, "partition")
        if slices is not None and partition is not None:
            raise ValueError("hardware has both slices and partition")
        if slices is not None and (slices[0] < 0 or slices[1] < 1):
            raise ValueError("hardware.slices must be [start >= 0, size >= 1]")
        if partition is not None and not 0 <= partition[0] < partition[1]:
            raise ValueError("hardware.partition must be [index, count], 0 <= index < count")
        return cls(gpu, slices, partition, multi)


@dataclass(frozen=True)
class MigRecord:
    """The MIG device behind a prepared device. `owned`: the driver created it for
    the claim and destroys it at unprepare (dynamic); otherwise it existed before
    (static) and is never touched. In a `PrepareStarted` entry an owned record is the
    intent (placement only, no ids yet); `PrepareCompleted` adds the ids and UUID.

    `before` (JSON `before`, on an intent only): the GPU-instance ids of the instances
    of this profile at this placement when the intent was journaled, normally none. A
    rollback of the intent destroys only an instance there whose id is not among them
    (and that no other entry records): the attempt's own. None (an intent written by an
    earlier release, or a record with ids): unknown, so an intent destroys nothing
    (docs/mig.md, "Crash safety").

    `boot` (JSON `boot`, on a record without a UUID only: an intent, or a GPU instance
    a failed create left): the node's boot id when it was journaled. What an attempt
    of another boot made did not survive the reboot, so such a record destroys
    nothing; None: unknown (an earlier release's, or no boot id to read)."""

    gpu_uuid: str
    profile_id: int
    slice_count: int
    placement: tuple[int, int]  # (start, size) in memory slices
    owned: bool
    gi_id: int | None = None
    ci_id: int | None = None
    uuid: str | None = None
    before: tuple[int, ...] | None = None
    boot: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "gpu": self.gpu_uuid,
            "profileId": self.profile_id,
            "sliceCount": self.slice_count,
            "placement": list(self.placement),
            "owned": self.owned,
            "giId": self.gi_id,
            "ciId": self.ci_id,
            "uuid": self.uuid,
        }
        if self.before is not None:  # absent otherwise: other records keep their bytes
            doc["before"] = sorted(self.before)
        if self.boot is not None:
            doc["boot"] = self.boot
        return doc

    @classmethod
    def from_json(cls, doc: object) -> MigRecord:
        if not isinstance(doc, Mapping):
            raise ValueError("mig must be an object")
        gpu, owned, uuid = doc.get("gpu"), doc.get("owned"), doc.get("uuid")
        placement = doc.get("placement")
        profile_id, slice_count = doc.get("profileId"), doc.get("sliceCount")
        gi_id, ci_id = doc.get("giId"), doc.get("ciId")
        if not isinstance(gpu, str) or not isinstance(owned, bool):
            raise ValueError("mig needs a string gpu and a boolean owned")
        if not (
            isinstance(placement, list)
            and len(placement) == 2
            and all(_is_int(v) for v in placement)
        ):
            raise ValueError("mig.placement must be [start, size]")
        if not _is_int(profile_id) or not _is_int(slice_count):
            raise ValueError("mig.profileId and mig.sliceCount must be integers")
        if not (gi_id is None or _is_int(gi_id)) or not (ci_id is None or _is_int(ci_id)):
            raise ValueError("mig.giId and mig.ciId must be integers or null")
        if uuid is not None and not isinstance(uuid, str):
            raise ValueError("mig.uuid must be a string or null")
        before = doc.get("before")
        if before is not None and not (
            isinstance(before, list) and all(_is_int(v) for v in before)
        ):
            raise ValueError("mig.before must be a list of integers")
        boot = doc.get("boot")
        if boot is not None and not isinstance(boot, str):
            raise ValueError("mig.boot must be a string")
        return cls(
            gpu,
            profile_id,
            slice_count,
            (placement[0], placement[1]),
            owned,
            gi_id,
            ci_id,
            uuid,
            None if before is None else tuple(before),
            boot,
        )
