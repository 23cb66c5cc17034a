"""The cluster's allocations for `gpu-dra validate --explain`: what the ResourceClaims
given with the slices (`kubectl get resourceslices,resourceclaims -A -o yaml`) already
hold of the published devices, counted as the scheduler counts them
(k8s.io/dynamic-resource-allocation/structured, `AllocatedState`):

- an allocation result without `shareID` takes the whole device;
- a result with `shareID` (a device with `allowMultipleAllocations`) takes its
  `consumedCapacity` of the device's capacity, and other shares fit in the rest;
- a device allocated either way consumes its `consumesCounters` from its pool's
  `sharedCounters` (a MIG GPU and its placements, a GPU and its partitions), so
  devices that need those counters may no longer fit;
- `adminAccess` results take nothing.

Only results of the driver explained (`--driver-name`) count; the explained claim's
own allocation (the same UID, else the same namespace and name) is left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from driver.cli.validate.capacity import Consumption, show_quantity
from driver.cli.validate.slice_devices import SliceDevice, counter_amounts
from driver.devices.formatting import parse_quantity

#: Kinds of exclusion by allocations, in the order the summary counts them.
CAPACITY, WHOLE, COUNTERS = "capacity", "whole", "counters"


@dataclass(frozen=True)
class ClaimRef:
    """Which claim: namespace, name and UID as far as its document says."""

    namespace: str | None
    name: str | None
    uid: str | None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> ClaimRef:
        meta = doc.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}

        def text(key: str) -> str | None:
            value = meta.get(key)
            return str(value) if isinstance(value, str) and value else None

        return cls(text("namespace"), text("name"), text("uid"))

    def same_claim(self, other: ClaimRef) -> bool:
        """The same claim: by UID where both have one, else by name (and namespace where
        both have one)."""
        if self.uid and other.uid:
            return self.uid == other.uid
        if self.name is None or self.name != other.name:
            return False
        namespaces = (self.namespace, other.namespace)
        return None in namespaces or namespaces[0] == namespaces[1]

    def __str__(self) -> str:
        name = self.name or self.uid or "?"
        return f"{self.namespace}/{name}" if self.namespace else name


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of a claim."""

    claim: ClaimRef
    pool: str
    device: str
    share_id: str | None
    consumed: Mapping[str, Decimal]

    @property
    def key(self) -> tuple[str, str]:
        return self.pool, self.device


@dataclass(frozen=True)
class Allocations:
    """The ResourceClaims given and the allocation results of the driver among them."""

    claims: tuple[ClaimRef, ...]
    results: tuple[AllocatedDevice, ...]

    @classmethod
    def read(cls, documents: Iterable[object], driver: str) -> Allocations | None:
        """None when `documents` (Lists' items too) hold no ResourceClaim."""
        claims: list[ClaimRef] = []
        results: list[AllocatedDevice] = []
        for doc in _flattened(documents):
            if not isinstance(doc, Mapping) or doc.get("kind") != "ResourceClaim":
                continue
            ref = ClaimRef.of(doc)
            claims.append(ref)
            results += _results(doc, ref, driver)
        return cls(tuple(claims), tuple(results)) if claims else None

    def without(self, claim: ClaimRef) -> tuple[Allocations, int]:
        """These allocations less those of `claim`, and how many results that left out."""
        kept = tuple(r for r in self.results if not r.claim.same_claim(claim))
        return Allocations(self.claims, kept), len(self.results) - len(kept)

    def summary(self, driver: str, published: set[tuple[str, str]]) -> str:
        allocated = {r.claim for r in self.results}
        whole = {r.key for r in self.results if r.share_id is None}
        shares = [r for r in self.results if r.share_id is not None]
        line = (
            f"allocations: {len(self.claims)} ResourceClaim(s) given, {len(allocated)} "
            f"allocated with devices of {driver}"
        )
        parts = [f"{len(whole)} device(s) allocated whole"] if whole else []
        if shares:
            parts.append(
                f"{len(shares)} share(s) of {len({r.key for r in shares})} shared device(s)"
            )
        line += f": {', '.join(parts)}" if parts else ""
        elsewhere = {r.key for r in self.results} - published
        if elsewhere:
            line += f"; {len(elsewhere)} allocated device(s) not in the slices"
        return line


def _flattened(documents: Iterable[object]) -> Iterable[object]:
    for doc in documents:
        if isinstance(doc, Mapping) and str(doc.get("kind", "")).endswith("List"):
            items = doc.get("items")
            yield from _flattened(items) if isinstance(items, list) else ()
        else:
            yield doc


def _results(doc: Mapping[str, Any], claim: ClaimRef, driver: str) -> list[AllocatedDevice]:
    status = doc.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    found = []
    for result in results if isinstance(results, list) else []:
        if not isinstance(result, Mapping) or result.get("driver") != driver:
            continue
        if result.get("adminAccess") is True:
            continue  # admin access takes nothing from other claims
        share = result.get("shareID")
        pool, device = str(result.get("pool")), str(result.get("device"))
        consumed = _quantities(result.get("consumedCapacity"))
        found.append(AllocatedDevice(claim, pool, device, str(share) if share else None, consumed))
    return found


def _quantities(values: object) -> dict[str, Decimal]:
    """A map of quantities (`consumedCapacity`); values that are not quantities left out."""
    amounts: dict[str, Decimal] = {}
    for name, value in values.items() if isinstance(values, Mapping) else ():
        try:
            amounts[str(name)] = parse_quantity(value)
        except (ValueError, TypeError):
            continue
    return amounts


def _consumes(device: SliceDevice) -> list[tuple[str, dict[str, Decimal]]]:
    entries = device.fields.get("consumesCounters")
    return [
        (str(e.get("counterSet")), counter_amounts(e.get("counters")))
        for e in (entries if isinstance(entries, list) else [])
        if isinstance(e, Mapping)
    ]


@dataclass
class Taken:
    """What `allocations` hold of `devices`: whole devices, the capacity of shared
    ones, and the counters of every allocated device."""

    whole: dict[tuple[str, str], list[ClaimRef]] = field(default_factory=dict)
    shared: dict[tuple[str, str], dict[str, Decimal]] = field(default_factory=dict)
    sharers: dict[tuple[str, str], set[ClaimRef]] = field(default_factory=dict)
    counters: dict[tuple[str, str], dict[str, Decimal]] = field(default_factory=dict)
    counters_used: dict[tuple[str, str, str], Decimal] = field(default_factory=dict)
    counter_holders: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        allocations: Allocations,
        devices: Iterable[SliceDevice],
        counters: Mapping[tuple[str, str], Mapping[str, Decimal]],
    ) -> Taken:
        taken = cls(counters={k: dict(v) for k, v in counters.items()})
        used: dict[tuple[str, str, str], Decimal] = defaultdict(Decimal)
        claims_of: dict[tuple[str, str], set[ClaimRef]] = defaultdict(set)
        for result in allocations.results:
            claims_of[result.key].add(result.claim)
            if result.share_id is None:
                taken.whole.setdefault(result.key, []).append(result.claim)
                continue
            consumed = taken.shared.setdefault(result.key, {})
            for name, amount in result.consumed.items():
                consumed[name] = consumed.get(name, Decimal(0)) + amount
            taken.sharers.setdefault(result.key, set()).add(result.claim)
        for device in devices:
            holders = claims_of.get(device.key)
            if not holders:
                continue
            who = f"{device.name} ({', '.join(sorted(str(c) for c in holders))})"
            for counter_set, amounts in _consumes(device):
                for name, amount in amounts.items():
                    key = (device.pool, counter_set, name)
                    used[key] += amount
                    taken.counter_holders.setdefault(key, []).append(who)
        taken.counters_used = dict(used)
        return taken

    def is_allocated(self, key: tuple[str, str]) -> bool:
        return key in self.whole or key in self.shared

    def why_taken(
        self, device: SliceDevice, consumption: Mapping[str, Consumption] | None
    ) -> tuple[str, str] | None:
        """(kind, why) when the allocations leave `device` unusable for a request that
        takes `consumption` of it (None: the device is not shared), else None."""
        if device.key in self.whole:
            claims = ", ".join(str(c) for c in self.whole[device.key])
            return WHOLE, f"allocated whole to {claims}"
        if device.key in self.shared and consumption is not None:
            why = self._short_capacity(device, consumption)
            if why is not None:
                return CAPACITY, why
        if not self.is_allocated(device.key):  # an allocated device's counters are counted
            why = self._short_counters(device)
            if why is not None:
                return COUNTERS, why
        return None

    def _short_capacity(
        self, device: SliceDevice, consumption: Mapping[str, Consumption]
    ) -> str | None:
        offered = device.fields.get("capacity")
        offered = offered if isinstance(offered, Mapping) else {}
        used = self.shared.get(device.key, {})
        claims = len(self.sharers.get(device.key, ()))
        for name in sorted(consumption, key=lambda n: (not consumption[n].named, n)):
            entry = offered.get(name)
            try:
                total = parse_quantity(entry.get("value") if isinstance(entry, Mapping) else None)
            except (ValueError, TypeError):
                continue
            taken, need = used.get(name, Decimal(0)), consumption[name]
            if taken + need.amount > total:
                why = f" {need.why}" if need.why else ""
                return (
                    f"capacity {name}: {show_quantity(total, name)}, "
                    f"{show_quantity(taken, name)} allocated to {claims} claim(s), "
                    f"{show_quantity(need.amount, name)} requested{why}"
                )
        return None

    def _short_counters(self, device: SliceDevice) -> str | None:
        for counter_set, amounts in _consumes(device):
            total = self.counters.get((device.pool, counter_set))
            if total is None:
                continue  # a counter set not in the slices: nothing known to count
            for name, need in sorted(amounts.items()):
                key = (device.pool, counter_set, name)
                used = self.counters_used.get(key, Decimal(0))
                if name in total and used + need > total[name]:
                    holders = self.counter_holders.get(key, [])
                    who = ", ".join(holders[:2]) + (
                        f" and {len(holders) - 2} more" if len(holders) > 2 else ""
                    )
                    return (
                        f"counter {counter_set}/{name}: {show_quantity(total[name], name)}, "
                        f"{show_quantity(used, name)} consumed by {who or 'nothing'}, "
                        f"{show_quantity(need, name)} needed"
                    )
        return None
