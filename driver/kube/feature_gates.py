"""Fields of a ResourceSlice that the API server keeps only with a feature gate on.

With a DRA gate off the API server does not refuse a slice that uses its fields: it
drops them silently and stores the rest. That is harmless for some fields and
dangerous for others: without `sharedCounters`/`consumesCounters` the scheduler
hands out a GPU and its partitions, or two overlapping MIG placements, to different
claims. So the publisher compares what it sent with what the API server answered
(`dropped_fields`) and fails the publish naming the gate (`DroppedFieldsError`).

Gate defaults (Kubernetes feature gates): DRAPartitionableDevices, DRADeviceTaints and
DRAConsumableCapacity are alpha, off, in 1.34 and 1.35 and beta, on, from 1.36.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

PARTITIONABLE: Final = "DRAPartitionableDevices"
TAINTS: Final = "DRADeviceTaints"
CONSUMABLE_CAPACITY: Final = "DRAConsumableCapacity"
DEFAULT_ON_FROM: Final = "1.36"

# What a missing field means for the node's users, by gate.
CONSEQUENCE: Final = {
    PARTITIONABLE: "without its counters the scheduler would hand out a GPU together with "
    "its partitions, or overlapping MIG placements",
    TAINTS: "failed GPUs would not be kept from new claims",
    CONSUMABLE_CAPACITY: "GPUs could not be shared by capacity",
}


@dataclass(frozen=True)
class DroppedField:
    gate: str
    field: str  # e.g. "devices[].consumesCounters"
    count: int  # how many of the slice's entries lost it


class DroppedFieldsError(Exception):
    """The API server dropped gated fields of a ResourceSlice; names the gates."""

    def __init__(self, slice_name: str, dropped: Iterable[DroppedField]) -> None:
        dropped = tuple(dropped)
        gates = sorted({d.gate for d in dropped})
        fields = ", ".join(f"{d.field} ({d.count})" for d in dropped)
        self.gates = tuple(gates)
        super().__init__(
            f"the API server dropped {fields} of ResourceSlice {slice_name}: the feature "
            f"gate{'s' if len(gates) > 1 else ''} {', '.join(gates)} "
            f"{'are' if len(gates) > 1 else 'is'} off (on by default from Kubernetes "
            f"{DEFAULT_ON_FROM}; turn {'them' if len(gates) > 1 else 'it'} on in "
            "kube-apiserver, kube-scheduler, kube-controller-manager and the kubelets, "
            "docs/install.md); " + "; ".join(CONSEQUENCE[g] for g in gates)
        )


def dropped_fields(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> list[DroppedField]:
    """The gated fields `sent` (a slice spec) sets that `stored` (the API server's
    answer) lacks. Only fields that change what the scheduler does count: a `false`
    allowMultipleAllocations, the default, may go."""
    found: list[DroppedField] = []

    def check(gate: str, field: str, lost: int) -> None:
        if lost:
            found.append(DroppedField(gate, field, lost))

    check(PARTITIONABLE, "sharedCounters", int(_lost(sent, stored, "sharedCounters")))
    stored_devices = {d.get("name"): d for d in stored.get("devices") or []}
    pairs = [(d, stored_devices.get(d.get("name")) or {}) for d in sent.get("devices") or []]
    for gate, key in (
        (PARTITIONABLE, "consumesCounters"),
        (TAINTS, "taints"),
        (CONSUMABLE_CAPACITY, "allowMultipleAllocations"),
    ):
        check(gate, f"devices[].{key}", sum(_lost(d, s, key) for d, s in pairs))
    check(
        CONSUMABLE_CAPACITY,
        "devices[].capacity[].requestPolicy",
        sum(
            _lost(capacity, (s.get("capacity") or {}).get(name) or {}, "requestPolicy")
            for d, s in pairs
            for name, capacity in (d.get("capacity") or {}).items()
        ),
    )
    return found


def _lost(sent: Mapping[str, Any], stored: Mapping[str, Any], key: str) -> bool:
    return bool(sent.get(key)) and not stored.get(key)
