"""PoolDevices -> ResourceSlice specs and documents within the API limits (pure).

One pool per node, split into as many slices as the resource.k8s.io/v1 limits need:
slices holding `sharedCounters` come first (at most 8 counter sets each, never with
devices), then device slices (at most 128 devices, or 64 when any device in the slice
consumes counters or carries taints). Order is the pool's preference order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from driver.devices.formatting import parse_quantity
from driver.devices.model import PoolDevices

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS = 64
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32
MAX_TAINTS_PER_DEVICE = 16
MAX_STRING_LENGTH = 64
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _check_taints(device: str, taints: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        raise ValueError(f"device {device}: {len(taints)} taints exceed {MAX_TAINTS_PER_DEVICE}")
    out = []
    for t in taints:
        if not t.get("key"):
            raise ValueError(f"device {device}: taint without a key: {dict(t)}")
        if t.get("effect") not in TAINT_EFFECTS:
            raise ValueError(f"device {device}: taint effect {t.get('effect')!r} is not valid")
        out.append(dict(t))
    return out


def _needs_small_slice(doc: Mapping[str, Any]) -> bool:
    return bool(doc.get("consumesCounters") or doc.get("taints"))


def _pack_devices(docs: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Greedy, order-preserving split honouring the per-slice device limits."""
    slices: list[list[dict[str, Any]]] = []
    small = False  # the last slice needs the smaller limit
    for doc in docs:
        small = small or _needs_small_slice(doc)
        limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS if small else MAX_DEVICES_PER_SLICE
        if not slices or len(slices[-1]) >= limit:
            slices.append([])
            small = _needs_small_slice(doc)
        slices[-1].append(doc)
    return slices


def build_slice_specs(
    pool: PoolDevices,
    *,
    driver: str,
    node_name: str,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    generation: int = 1,
) -> list[dict[str, Any]]:
    """Ordered ResourceSlice `spec`s for the node's pool (at least one, possibly empty).

    `taints` maps a device name to the taints (`key`, `value`, `effect`) placed on its
    document; names not in the pool are ignored.
    """
    taints = taints or {}
    # A shallow copy of a tainted document: its nested values are shared, never mutated.
    docs = [
        {**d.document, "taints": _check_taints(d.name, taints[d.name])}
        if taints.get(d.name)
        else d.document
        for d in pool.devices
    ]
    sets = pool.counter_sets
    bodies: list[dict[str, Any]] = [
        {"sharedCounters": list(sets[i : i + MAX_COUNTER_SETS_PER_SLICE])}
        for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
    ]
    bodies += [{"devices": chunk} for chunk in _pack_devices(docs)]
    bodies = bodies or [{"devices": []}]
    pool_ref = {"name": node_name, "generation": generation, "resourceSliceCount": len(bodies)}
    return [
        {"driver": driver, "nodeName": node_name, "pool": dict(pool_ref), **body} for body in bodies
    ]


def slice_generate_name(index: int, count: int, driver: str, node_name: str) -> str:
    """`<index as lowercase hex, zero-padded to max(5, digits of count-1)>-<driver>-<node>-`."""
    width = max(5, len(f"{max(count - 1, 0):x}"))
    return f"{index:0{width}x}-{driver}-{node_name}-"


def build_slice_documents(
    pool: PoolDevices,
    *,
    driver: str,
    node_name: str,
    node_uid: str | None = None,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    generation: int = 1,
) -> list[dict[str, Any]]:
    """Full ResourceSlice objects (generateName, owner the Node) for the pool."""
    specs = build_slice_specs(
        pool, driver=driver, node_name=node_name, taints=taints, generation=generation
    )
    return slice_documents(specs, driver=driver, node_name=node_name, node_uid=node_uid)


def slice_documents(
    specs: Sequence[dict[str, Any]], *, driver: str, node_name: str, node_uid: str | None = None
) -> list[dict[str, Any]]:
    """The ResourceSlice objects of one pool's ordered specs."""
    docs = []
    for i, spec in enumerate(specs):
        name = slice_generate_name(i, len(specs), driver, node_name)
        metadata: dict[str, Any] = {"generateName": name}
        if node_uid is not None:
            owner = dict(
                apiVersion="v1", kind="Node", name=node_name, uid=node_uid, controller=True
            )
            metadata["ownerReferences"] = [owner]
        docs.append(
            {"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata, "spec": spec}
        )
    return docs


def _policy_errors(cap: Mapping[str, Any]) -> list[str]:
    """What the API server refuses in a capacity's request policy (DRAConsumableCapacity)."""
    policy = cap.get("requestPolicy")
    if policy is None:
        return []
    try:
        value = parse_quantity(cap.get("value"))
        default = parse_quantity(policy.get("default"))
        valid_range = policy.get("validRange")
        if valid_range is not None and policy.get("validValues") is not None:
            return ["validRange and validValues are mutually exclusive"]
        if default > value:
            return [f"default {policy.get('default')} exceeds the capacity {cap.get('value')}"]
        if valid_range is None:
            return []
        low = parse_quantity(valid_range.get("min"))
        high = parse_quantity(valid_range["max"]) if "max" in valid_range else value
        step = parse_quantity(valid_range["step"]) if "step" in valid_range else None
    except (ValueError, TypeError, AttributeError) as err:
        return [f"malformed requestPolicy: {err}"]
    errors = []
    if not low <= default <= high or high > value:
        errors.append("default or max outside [min, capacity]")
    if step is not None and step <= 0:
        errors.append(f"validRange step {valid_range['step']} must be positive")
    elif step is not None and ((high - low) % step or (default - low) % step):
        errors.append("max and default must be min plus a multiple of step")
    return errors


def validate_slice_specs(specs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every API-limit or pool-consistency violation in a pool's slice specs (empty: valid)."""
    errors: list[str] = []
    counter_sets: dict[str, set[str]] = {}
    device_names: set[str] = set()
    pools = {(s.get("pool") or {}).get("name") for s in specs}
    if len(pools) != 1:
        errors.append(f"slices span pools {sorted(map(str, pools))}")
    for i, spec in enumerate(specs):
        bad: list[str] = []  # this slice's violations
        count = (spec.get("pool") or {}).get("resourceSliceCount")
        if count != len(specs):
            bad.append(f"resourceSliceCount {count} != {len(specs)}")
        devices = spec.get("devices")
        shared = spec.get("sharedCounters")
        if devices and shared:
            bad.append("has both devices and sharedCounters")
        for cs in shared or []:
            name = cs.get("name", "")
            if not _DNS_LABEL.match(name):
                bad.append(f"counter set name {name!r} is not a DNS label")
            if name in counter_sets:
                bad.append(f"duplicate counter set {name}")
            counters = cs.get("counters") or {}
            if not counters:
                bad.append(f"counter set {name} has no counters")
            if len(counters) > MAX_COUNTERS_PER_SET:
                bad.append(f"counter set {name} has {len(counters)} counters")
            counter_sets[name] = set(counters)
        if shared is not None and len(shared) > MAX_COUNTER_SETS_PER_SLICE:
            bad.append(f"{len(shared)} counter sets > {MAX_COUNTER_SETS_PER_SLICE}")
        devices = devices or []
        small = any(_needs_small_slice(d) for d in devices)
        limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS if small else MAX_DEVICES_PER_SLICE
        if len(devices) > limit:
            bad.append(f"{len(devices)} devices > {limit}")
        for d in devices:
            name = d.get("name", "")
            if not _DNS_LABEL.match(name):
                bad.append(f"device name {name!r} is not a DNS label")
            if name in device_names:
                bad.append(f"duplicate device {name}")
            device_names.add(name)
            device = f"device {name}"
            attrs = d.get("attributes") or {}
            capacity = d.get("capacity") or {}
            if len(attrs) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
                bad.append(f"{device} has {len(attrs) + len(capacity)} attrs+caps")
            for key, value in attrs.items():
                if len(value) != 1:
                    bad.append(f"{device} attribute {key} needs exactly one type")
                for kind in ("string", "version"):
                    if kind in value and len(str(value[kind])) > MAX_STRING_LENGTH:
                        bad.append(f"{device} attribute {key} is too long")
                if "version" in value and not re.match(r"^\d+\.\d+\.\d+$", str(value["version"])):
                    bad.append(f"{device} attribute {key} is not semver")
            for key, cap in capacity.items():
                if "requestPolicy" in cap and d.get("allowMultipleAllocations") is not True:
                    bad.append(
                        f"{device} capacity {key} has a requestPolicy without "
                        "allowMultipleAllocations"
                    )
                bad += [f"{device} capacity {key}: {e}" for e in _policy_errors(cap)]
            consumptions = d.get("consumesCounters") or []
            if len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
                bad.append(f"{device} has {len(consumptions)} consumptions")
            seen_sets = set()
            for c in consumptions:
                if c.get("counterSet") in seen_sets:
                    bad.append(f"{device} consumes {c.get('counterSet')} twice")
                seen_sets.add(c.get("counterSet"))
                if len(c.get("counters") or {}) > MAX_COUNTERS_PER_CONSUMPTION:
                    bad.append(f"{device} consumes too many counters")
            taints = d.get("taints") or []
            if len(taints) > MAX_TAINTS_PER_DEVICE:
                bad.append(f"{device} has {len(taints)} taints")
            bad += [
                f"{device} taint effect {t.get('effect')!r}"
                for t in taints
                if t.get("effect") not in TAINT_EFFECTS
            ]
        errors += [f"slice {i}: {problem}" for problem in bad]
    # References are checked once every counter set of the pool is known.
    for i, spec in enumerate(specs):
        for d in spec.get("devices") or []:
            for c in d.get("consumesCounters") or []:
                device, set_name = f"slice {i}: device {d.get('name')}", c.get("counterSet")
                known = counter_sets.get(c.get("counterSet", ""))
                missing = sorted(set(c.get("counters") or {}) - (known or set()))
                if known is None:
                    errors.append(f"{device} consumes unknown counter set {set_name}")
                elif missing:
                    errors.append(f"{device} consumes unknown counters {missing} of {set_name}")
    return errors
