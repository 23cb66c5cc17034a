"""The node's double-booking guard: no piece of hardware goes to two claims, and a
multi-allocatable device is never shared beyond its capacity.

The scheduler's counters and capacities already keep allocations apart; this guard
protects against what it cannot see (a claim force-deleted while its pod still runs,
a stale allocation, two prepares racing for a freed device, a pool republished with
other partitions while claims hold devices of the old one). Each side is judged by
its journal record (`PreparedDevice.hardware`, set at planning: GPU UUID, MIG slices
or `--gpu-partitions` span, multi-allocatable), not by what the node publishes today.
Devices overlap when they share hardware (`HardwareRecord.overlaps`): a whole GPU and
anything of it, MIG devices whose slice ranges intersect, partitions whose fractions
of the GPU do. Admin-access devices and other pools never count. Shares
(allocations with a shareID) of the same multi-allocatable device
(`--gpu-allow-multiple-allocations`, docs/sharing.md; the same name and the same
record on both sides) do not overlap each other, but the `consumedCapacity` of every
share of the device, held and new, must fit in the device's capacity (a share
without a recorded consumption counts as the whole device). Any other pair of
shares, or a share and an exclusive allocation, follows the hardware rule.

A device of an entry written by an earlier release has no record: it is judged by
the device of that name in today's pool (its MIG record, where it has one, gives GPU
and slices); when neither tells, the new claim is refused (transient, naming both
claims) until the old one is unprepared.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal

from driver.devices.formatting import parse_quantity
from driver.errors import DriverError, ErrorClass, transient
from driver.state.journal.checkpoint import ClaimEntry, HardwareRecord, PreparedDevice
from driver.state.request import PreparableDevice


class HeldError(DriverError):
    """A planned device overlaps one another journal entry holds: transient, and
    `holder` names that claim (a prepare waits for it while its request is in
    flight, driver/state/plan.py)."""

    def __init__(self, holder: str, message: str) -> None:
        super().__init__(ErrorClass.TRANSIENT, message)
        self.holder = holder


def _partition_span(
    device: PreparableDevice, devices: Mapping[str, PreparableDevice]
) -> tuple[int, int] | None:
    """(index, count) of a `--gpu-partitions` partition: its `partition` attribute
    among the partitions its GPU publishes. None if the pool does not tell."""
    attributes = device.document.get("attributes") or {}
    index = (attributes.get("partition") or {}).get("int")
    count = sum(
        1
        for d in devices.values()
        if d.gpu_uuid == device.gpu_uuid and d.is_partition and d.mig is None and not d.placement
    )
    if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < count:
        return (index, count)
    return None


def hardware_of(
    device: PreparableDevice, devices: Mapping[str, PreparableDevice]
) -> HardwareRecord:
    """The record of a published device (`devices`: the pool it is published in). A
    partition whose span the pool does not tell is recorded as its whole GPU, so it
    overlaps everything of that GPU rather than nothing."""
    slices = device.mig.placement if device.mig is not None else device.placement
    partition = _partition_span(device, devices) if device.is_partition and not slices else None
    return HardwareRecord(
        device.gpu_uuid,
        slices=slices or None,
        partition=partition,
        multi_allocatable=device.share_capacity is not None,
    )


def _record(
    device: PreparedDevice, devices: Mapping[str, PreparableDevice]
) -> HardwareRecord | None:
    """What the journal records of `device`; for an entry of an earlier release its
    MIG record, else the device of that name in today's pool; None if neither."""
    if device.hardware is not None:
        return device.hardware
    if device.mig is not None:
        return HardwareRecord(device.mig.gpu_uuid, slices=device.mig.placement)
    published = devices.get(device.device_name)
    return hardware_of(published, devices) if published is not None else None


def conflict(
    held: PreparedDevice, new: PreparedDevice, devices: Mapping[str, PreparableDevice]
) -> tuple[str, str] | None:
    """Why `new` may not be prepared while another claim holds `held`, or None: how
    the two relate (said before the holder) and why (said after it)."""
    if held.admin_access or new.admin_access or held.pool_name != new.pool_name:
        return None
    a, b = _record(held, devices), _record(new, devices)
    if a is None or b is None:
        unknown = held if a is None else new
        return (
            f"device {new.device_name} cannot be checked against device {held.device_name}",
            f": the journal does not record which hardware {unknown.device_name} is "
            "(an entry of an earlier release) and this node no longer publishes it",
        )
    same = held.device_name == new.device_name and a == b
    if same and held.share_id and new.share_id and a.multi_allocatable:
        return None  # shares: their sum is checked against the capacity
    if same or a.overlaps(b):
        return f"device {new.device_name} overlaps device {held.device_name}", ""
    return None


def consumed(device: PreparedDevice, capacity: Mapping[str, int]) -> dict[str, Decimal]:
    """What a share consumes of each capacity; unknown (or unparsable) is all of it."""
    recorded = dict(device.consumed_capacity)
    out: dict[str, Decimal] = {}
    for name, total in capacity.items():
        try:
            out[name] = parse_quantity(recorded[name])
        except (KeyError, ValueError):
            out[name] = Decimal(total)
    return out


def refuse_over_capacity(
    uid: str,
    planned: tuple[PreparedDevice, ...],
    devices: Mapping[str, PreparableDevice],
    *entry_maps: Mapping[str, ClaimEntry],
) -> None:
    """Raise a transient error if the new shares of a multi-allocatable device, with
    those the other entries of all `entry_maps` hold (the journal and the claims
    planned before in the same request), consume more than the device's capacity."""
    for key in {(p.pool_name, p.device_name) for p in planned if p.share_id}:
        published = devices.get(key[1])
        capacity = published.share_capacity if published is not None else None
        if capacity is None:
            continue
        new = [p for p in planned if p.share_id and (p.pool_name, p.device_name) == key]
        held = [
            (other_uid, entry, d)
            for entries in entry_maps
            for other_uid, entry in entries.items()
            if other_uid != uid
            for d in entry.devices
            if d.share_id and not d.admin_access and (d.pool_name, d.device_name) == key
        ]
        for name, total in capacity.items():
            used = sum((consumed(d, capacity)[name] for _, _, d in held), Decimal(0))
            asked = sum((consumed(p, capacity)[name] for p in new), Decimal(0))
            if used + asked > total:
                holders = (
                    ", ".join(f"{e.namespace}/{e.name} ({u})" for u, e, _ in held)
                    or "no other claim"
                )
                raise transient(
                    f"device {key[1]}: the new share(s) consume {name} {asked} but only "
                    f"{total - used} of {total} is left (shares held by {holders}); "
                    "refusing to share it beyond its capacity"
                )


def refuse_double_booking(
    uid: str,
    planned: tuple[PreparedDevice, ...],
    entries: Mapping[str, ClaimEntry],
    devices: Mapping[str, PreparableDevice],
) -> None:
    """Raise `HeldError` if a planned device overlaps one held by another entry, or a
    transient error if shares of a multi-allocatable device would exceed its
    capacity (counting this mapping's entries only: `refuse_over_capacity` sums over
    several)."""
    for other_uid, entry in entries.items():
        if other_uid == uid:
            continue
        for held in entry.devices:
            for new in planned:
                why = conflict(held, new, devices)
                if why is not None:
                    raise HeldError(
                        other_uid,
                        f"{why[0]} already prepared for claim {entry.namespace}/{entry.name} "
                        f"({other_uid}, {entry.state}){why[1]}; refusing to hand it to a "
                        f"second claim ({uid})",
                    )
    refuse_over_capacity(uid, planned, devices, entries)
