"""The node's double-booking guard: no piece of hardware goes to two claims, and a
multi-allocatable device is never shared beyond its capacity.

The scheduler's counters and capacities already keep allocations apart; this guard
protects against what it cannot see (a claim force-deleted while its pod still runs,
a stale allocation, two prepares racing for a freed device). Devices overlap when
they share hardware: the same device, a whole GPU and any partition of it, or two
MIG partitions of one GPU whose memory-slice ranges intersect. Admin-access devices
never count. Shares (allocations with a shareID) of a multi-allocatable device
(`--gpu-allow-multiple-allocations`, docs/sharing.md) do not overlap each other, but
the `consumedCapacity` of every share of the device, held and new, must fit in the
device's capacity (a share without a recorded consumption counts as the whole
device). A share and an exclusive allocation of one device always overlap.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal

from driver.devices.documents import parse_quantity
from driver.errors import transient
from driver.state.checkpoint import ClaimEntry, PreparedDevice
from driver.state.claims import PreparableDevice


def _share_capacity(published: PreparableDevice | None) -> Mapping[str, int] | None:
    capacity = getattr(published, "share_capacity", None)
    return capacity if isinstance(capacity, Mapping) else None


def _placement(
    device: PreparedDevice, published: PreparableDevice | None
) -> tuple[int, int] | None:
    if device.mig is not None:
        return device.mig.placement
    return published.placement if published is not None else None


def overlap(
    held: PreparedDevice, new: PreparedDevice, devices: Mapping[str, PreparableDevice]
) -> bool:
    if held.admin_access or new.admin_access or held.pool_name != new.pool_name:
        return False
    if held.share_id and new.share_id:
        # Shares (only the scheduler hands out shareIDs, only for multi-allocatable
        # devices): their sum is checked against the capacity by refuse_over_capacity.
        return False
    if held.device_name == new.device_name:
        return True
    a, b = devices.get(held.device_name), devices.get(new.device_name)
    if a is None or b is None or a.gpu_uuid != b.gpu_uuid:
        return False
    if a.is_partition != b.is_partition:  # a whole GPU and one of its partitions
        return True
    pa, pb = _placement(held, a), _placement(new, b)
    if pa is None or pb is None:  # two equal shares of one GPU's counters (reference)
        return False
    return pa[0] < pb[0] + pb[1] and pb[0] < pa[0] + pa[1]


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
        capacity = _share_capacity(devices.get(key[1]))
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
    """Raise a transient error if a planned device overlaps one held by another entry,
    or shares of a multi-allocatable device would exceed its capacity (counting this
    mapping's entries only: `refuse_over_capacity` sums over several)."""
    for other_uid, entry in entries.items():
        if other_uid == uid:
            continue
        for held in entry.devices:
            for new in planned:
                if overlap(held, new, devices):
                    raise transient(
                        f"device {new.device_name} overlaps device {held.device_name} "
                        f"already prepared for claim {entry.namespace}/{entry.name} "
                        f"({other_uid}, {entry.state}); refusing to hand it to a second claim"
                    )
    refuse_over_capacity(uid, planned, devices, entries)
