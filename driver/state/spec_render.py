"""Stage 4 of a prepare (driver/state/prepare.py): each claim's CDI spec, rendered
from its planned devices once their MIG devices exist, and written.

Per device the spec has its env (the reference's names, `claim_device_env`),
`NVIDIA_VISIBLE_DEVICES=void` and, on real GPUs, its own device nodes, so a container
that references one request of the claim gets that request's devices only; the
control nodes and the driver's files are in the common spec (driver/cdi/common_spec.py).
`respec_restored` is start-up recovery's: the spec after recreated MIG devices got new
UUIDs and ids.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from driver.cdi.claim_specs import (
    PROFILE,
    VISIBLE_DEVICES_VOID,
    CdiDevice,
    CdiHook,
    CdiMount,
    ClaimSpec,
)
from driver.cdi.device_nodes import CharMajors, DeviceNode, DeviceNodeError
from driver.cdi.memory_limit_hook import MemoryLimitSite
from driver.errors import transient
from driver.nvml.mig.caps import CapabilityError, mig_capabilities
from driver.state.journal.checkpoint import MigRecord, PreparedDevice

_NON_ALNUM = re.compile(r"[^A-Za-z0-9]+")


def device_key(device_name: str) -> str:
    """`gpu-0-partition-1` -> `GPU_0_PARTITION_1` (for `<PROFILE>_DEVICE_<key>_RESOURCE_CLAIM`)."""
    return _NON_ALNUM.sub("_", device_name).upper()


def gpu_env_id(device_name: str) -> str:
    """The reference's gpu env id: name without `gpu-`, upper-cased, `-` -> `_`
    (`gpu-0` -> `0`, `gpu-0-partition-1` -> `0_PARTITION_1`)."""
    return device_name.removeprefix("gpu-").upper().replace("-", "_")


@dataclass(frozen=True)
class SharingEnv:
    """The effective sharing settings of one device, as the env vars carry them."""

    strategy: str  # "TimeSlicing" | "SpacePartitioning"
    interval: str | None = None  # TimeSlicing only
    partition_count: int | None = None  # SpacePartitioning only


def claim_device_env(
    *,
    claim_uid: str,
    device_name: str,
    admin_access: bool,
    sharing: SharingEnv,
    consumed_capacity: Mapping[str, Any] | None = None,
) -> list[str]:
    """The reference's env list for one prepared gpu device, in the reference's order."""
    gid = gpu_env_id(device_name)
    env = [
        f"{PROFILE.upper()}_DEVICE_{device_key(device_name)}_RESOURCE_CLAIM={claim_uid}",
        f"DRA_ADMIN_ACCESS={'true' if admin_access else 'false'}",
        f"GPU_DEVICE_{gid}={device_name}",
        f"GPU_DEVICE_{gid}_SHARING_STRATEGY={sharing.strategy}",
    ]
    if sharing.strategy == "TimeSlicing":
        env.append(f"GPU_DEVICE_{gid}_TIMESLICE_INTERVAL={sharing.interval or 'Default'}")
    elif sharing.strategy == "SpacePartitioning":
        count = sharing.partition_count if sharing.partition_count is not None else 1
        env.append(f"GPU_DEVICE_{gid}_PARTITION_COUNT={count}")
    consumed = consumed_capacity or {}
    if "memory" in consumed:
        env.append(f"GPU_DEVICE_{gid}_MEMORY={consumed['memory']}")
    if "compute" in consumed:
        env.append(f"GPU_DEVICE_{gid}_COMPUTE={consumed['compute']}")
    return env


@dataclass(frozen=True)
class PlannedDevice:
    prepared: PreparedDevice
    cdi_name: str
    env: tuple[str, ...]
    gpu_uuid: str
    gpu_minor: int | None
    mounts: tuple[CdiMount, ...] = ()
    # The memory-limit hook of a device with a memory share, where the GPU's driver
    # has per-cgroup limits (driver/cdi/memory_limit_hook.py).
    hooks: tuple[CdiHook, ...] = ()


def with_mig(planned: PlannedDevice, record: MigRecord) -> PlannedDevice:
    return replace(planned, prepared=replace(planned.prepared, mig=record))


@dataclass(frozen=True)
class CdiContext:
    """How specs are rendered on this node."""

    real_devices: bool  # device nodes for real GPUs
    caps_root: Path  # where /proc/driver/nvidia/capabilities is read (real: "/")
    proc_devices: Path = Path("/proc/devices")  # the kernel's device majors
    # The majors already read for this batch (`with_majors`): one read per request.
    read_majors: CharMajors | None = None
    # Where the plugin sets memory shares as cgroup limits; None: nowhere, no hooks.
    memory_limits: MemoryLimitSite | None = None

    def majors(self) -> CharMajors:
        if self.read_majors is not None:
            return self.read_majors
        try:
            return CharMajors.read(self.proc_devices)
        except OSError as err:
            raise transient(f"cannot read device majors from {self.proc_devices}: {err}") from err


def for_batch(context: CdiContext, known: CharMajors | None) -> CdiContext:
    """The context for one request's specs: the majors read once (`known`: what the
    common spec's refresh just read), not once per claim."""
    if not context.real_devices:
        return context
    return replace(context, read_majors=known if known is not None else context.majors())


def _uuid_env(planned: PlannedDevice) -> tuple[str, ...]:
    """A MIG device's UUID, which exists only once prepare created it."""
    mig = planned.prepared.mig
    if mig is None:
        return ()
    if mig.uuid is None:
        raise transient(f"device {planned.prepared.device_name}: its MIG device has no UUID")
    return (f"GPU_DEVICE_{gpu_env_id(planned.prepared.device_name)}_UUID={mig.uuid}",)


def _mig_nodes(
    majors: CharMajors, context: CdiContext, gpu_minor: int, gi_id: int, ci_id: int
) -> tuple[DeviceNode, ...]:
    try:
        caps = mig_capabilities(context.caps_root, gpu_minor, gi_id, ci_id)
        return tuple(majors.capability_node(cap) for cap in caps)
    except (CapabilityError, DeviceNodeError) as err:
        raise transient(str(err)) from err


def _device_nodes(
    planned: PlannedDevice, context: CdiContext, majors: CharMajors
) -> tuple[DeviceNode, ...]:
    if planned.gpu_minor is None:
        return ()
    try:
        parent = majors.gpu_node(planned.gpu_minor)
    except DeviceNodeError as err:
        raise transient(str(err)) from err
    mig = planned.prepared.mig
    if mig is None:
        return (parent,)
    if mig.gi_id is None or mig.ci_id is None:
        raise transient(f"device {planned.prepared.device_name}: MIG device ids unknown")
    return (parent, *_mig_nodes(majors, context, planned.gpu_minor, mig.gi_id, mig.ci_id))


def render_spec(planned: Sequence[PlannedDevice], context: CdiContext) -> ClaimSpec:
    """The claim's CDI spec: one device per prepared device with only its own env and
    nodes (the control nodes and the driver's files are in the common spec)."""
    majors = context.majors() if context.real_devices else None
    devices = tuple(
        CdiDevice(
            name=p.cdi_name,
            env=(*p.env, *_uuid_env(p), VISIBLE_DEVICES_VOID),
            device_nodes=_device_nodes(p, context, majors) if majors is not None else (),
            mounts=p.mounts,
            hooks=p.hooks,
        )
        for p in planned
    )
    return ClaimSpec(devices)


def respec_restored(
    spec: ClaimSpec,
    old: Sequence[PreparedDevice],
    new: Sequence[PreparedDevice],
    context: CdiContext,
) -> ClaimSpec:
    """The claim's spec after `restore` recreated MIG devices (new UUIDs and ids):
    the old UUIDs in every env replaced, and the capability nodes of the recreated
    devices re-read. Everything else stays byte for byte."""
    uuids: dict[str, str] = {}
    nodes: dict[str, tuple[DeviceNode, ...]] = {}
    majors = context.majors() if context.real_devices else None
    for before, after in zip(old, new, strict=True):
        if before.mig is None or after.mig is None or before.mig == after.mig:
            continue
        if before.mig.uuid and after.mig.uuid:
            uuids[before.mig.uuid] = after.mig.uuid
        name = after.cdi_device_ids[0].split("=", 1)[-1]
        if majors is not None and after.mig.gi_id is not None and after.mig.ci_id is not None:
            found = _parent_node(spec, name)
            if found is not None:
                caps = _mig_nodes(majors, context, found[1], after.mig.gi_id, after.mig.ci_id)
                nodes[name] = (found[0], *caps)

    def env(values: tuple[str, ...]) -> tuple[str, ...]:
        for before, after in uuids.items():
            values = tuple(value.replace(before, after) for value in values)
        return values

    devices = tuple(
        replace(d, env=env(d.env), device_nodes=nodes.get(d.name, d.device_nodes))
        for d in spec.devices
    )
    return ClaimSpec(devices, spec.device_nodes)


def _parent_node(spec: ClaimSpec, name: str) -> tuple[DeviceNode, int] | None:
    """The GPU node of the spec's device `name` (its first) and that GPU's minor."""
    for device in spec.devices:
        if device.name == name and device.device_nodes:
            node = device.device_nodes[0]
            tail = node.path.removeprefix("/dev/nvidia")
            return (node, int(tail)) if tail.isdigit() else None
    return None
