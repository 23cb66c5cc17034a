"""The node's double-booking guard: no piece of hardware goes to two claims.

The scheduler's counters already keep allocations apart; this guard protects against
what it cannot see (a claim force-deleted while its pod still runs, a stale
allocation, two prepares racing for a freed device). Devices overlap when they share
hardware: the same device, a whole GPU and any partition of it, or two MIG
partitions of one GPU whose memory-slice ranges intersect. Shares of one
multi-allocatable device (both with a shareID) and admin-access devices never count.
"""

from __future__ import annotations

from collections.abc import Mapping

from driver.errors import transient
from driver.state.checkpoint import ClaimEntry, PreparedDevice
from driver.state.claims import PreparableDevice


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
    if held.share_id and new.share_id:  # shares of multi-allocatable devices
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


def refuse_double_booking(
    uid: str,
    planned: tuple[PreparedDevice, ...],
    entries: Mapping[str, ClaimEntry],
    devices: Mapping[str, PreparableDevice],
) -> None:
    """Raise a transient error if a planned device overlaps one held by another entry."""
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
