"""Planning a claim (no NVML, no disk) and rendering its CDI spec.

`plan_claim` resolves the claim's configs, checks device health and the device rules,
and yields one `PlannedDevice` per allocated device: the journal's `PreparedDevice`
(with the MIG intent where a MIG device must be created) and the device's env. Once
the MIG devices exist, `render_spec` builds the CDI spec: per device its env,
`NVIDIA_VISIBLE_DEVICES=void` and on real GPUs its own device nodes, so a container
that references one request of the claim gets that request's devices only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from driver.cdi.claim_specs import (
    VISIBLE_DEVICES_VOID,
    CdiDevice,
    CdiMount,
    ClaimSpec,
    SharingEnv,
    cdi_device_name,
    claim_device_env,
    gpu_env_id,
)
from driver.cdi.device_nodes import CharMajors, DeviceNode, DeviceNodeError
from driver.config import (
    ConfigError,
    GpuConfig,
    Interval,
    resolve_configs,
    validate_for_device,
)
from driver.errors import device_failed, transient
from driver.nvml.caps import CapabilityError, mig_capabilities
from driver.state.booking import hardware_of
from driver.state.claims import ClaimRef, DeviceHealth, PreparableDevice
from driver.state.journal.checkpoint import MigRecord, PreparedDevice
from driver.state.journal.timeslice_record import TimeSliceRecord
from driver.state.mps.claim_daemons import MpsSite, plan_mps
from driver.state.mps.prepared_limits import allotment, mps_limits


@dataclass(frozen=True)
class PlannedDevice:
    prepared: PreparedDevice
    cdi_name: str
    env: tuple[str, ...]
    gpu_uuid: str
    gpu_minor: int | None
    mounts: tuple[CdiMount, ...] = ()


@dataclass(frozen=True)
class CdiContext:
    """How specs are rendered on this node."""

    real_devices: bool  # device nodes for real GPUs
    caps_root: Path  # where /proc/driver/nvidia/capabilities is read (real: "/")
    proc_devices: Path = Path("/proc/devices")  # the kernel's device majors
    # The majors already read for this batch (`with_majors`): one read per request.
    read_majors: CharMajors | None = None

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


def _sharing_env(config: GpuConfig) -> SharingEnv:
    return SharingEnv(
        strategy=config.strategy.value,
        interval=config.interval.value if config.interval is not None else None,
        partition_count=config.partition_count,
    )


def check_health(ref: ClaimRef, results: Sequence[dict[str, Any]], health: DeviceHealth) -> None:
    """A failed allocated device is tainted (waiting until the API server accepted
    the taint), then the claim fails permanently with device-failed."""
    failed: list[str] = []
    for result in results:
        name = str(result.get("device"))
        reason = health.failure(name)
        if reason is not None:
            failed.append(f"{name}: {reason}")
            try:
                health.ensure_tainted(name)
            except Exception as err:  # not permanent until the API accepted the taint
                raise transient(
                    f"device {name} failed ({reason}) but tainting it failed: {err}"
                ) from err
    if failed:
        raise device_failed(
            f"allocated device(s) unusable for claim {ref.namespace}/{ref.name}: "
            + "; ".join(failed)
            + " (tainted; the scheduler will not pick them again)"
        )


def _mig_intent(device: PreparableDevice) -> MigRecord | None:
    backing = device.mig
    if backing is None:
        return None
    existing = backing.existing
    return MigRecord(
        gpu_uuid=device.gpu_uuid,
        profile_id=backing.profile_id,
        slice_count=backing.slice_count,
        placement=backing.placement,
        owned=existing is None,
        gi_id=existing.gi_id if existing is not None else None,
        ci_id=existing.ci_id if existing is not None else None,
        uuid=existing.uuid if existing is not None else None,
    )


def _no_time_slice(device: PreparableDevice, admin: bool) -> str | None:
    """Why no time-slice interval can be set for this device, or None: the setting is
    the physical GPU's, so never through a MIG device (nor the whole GPU of a GPU in MIG
    mode, delivered as a full-size MIG device) or an admin-access claim."""
    if device.mig is not None:
        return "a MIG device: its GPU is in MIG mode"
    if admin:
        return "with admin access, which observes a GPU other claims use"
    return None


def _time_slice(config: GpuConfig, device: PreparableDevice, admin: bool) -> TimeSliceRecord | None:
    """The interval to set on the device's GPU (driver/state/timeslice.py): TimeSlicing
    with a non-Default interval, on a device that can take one (`_no_time_slice`)."""
    interval = config.interval
    if interval is None or interval is Interval.DEFAULT or _no_time_slice(device, admin):
        return None
    return TimeSliceRecord(device.gpu_uuid, interval.value)


def plan_claim(
    ref: ClaimRef,
    claim: dict[str, Any],
    driver_results: Sequence[dict[str, Any]],
    *,
    driver_name: str,
    devices: Mapping[str, PreparableDevice],
    cdi_ids: Callable[[str, str, str | None], list[str]],
    time_slices: bool = False,
    mps_site: MpsSite | None = None,
) -> tuple[PlannedDevice, ...]:
    """Raises ConfigError (permanent invalid-config) or a transient error. Device
    health is checked before (`check_health`), outside the node lock. `time_slices`:
    the backend sets time-slice intervals, so they are recorded. `mps_site`: where
    MPS daemons live, None on a node without MPS (driver/state/mps/claim_daemons.py)."""
    configs = resolve_configs(claim["status"]["allocation"], driver_name)
    planned: list[PlannedDevice] = []
    for result in driver_results:
        name = str(result.get("device"))
        device = devices.get(name)
        if device is None:
            raise transient(
                f"requested device is not allocatable: {name} (not published by this node)"
            )
        request = str(result.get("request"))
        config = configs[request]
        admin = bool(result.get("adminAccess", False))
        validate_for_device(
            config,
            device_name=name,
            is_partition=device.is_partition,
            max_partitions=device.max_partitions,
            share=bool(result.get("shareID")),
            no_time_slice=_no_time_slice(device, admin),
        )
        share_id = result.get("shareID") or None
        consumed = result.get("consumedCapacity") or {}
        cdi_name = cdi_device_name(ref.uid, name, share_id)
        # MPS serves a GPU with MIG off, never with admin access (observing); the
        # allotment (a walk of the pool) only where a daemon may limit the device.
        mps_here = mps_site is not None and _no_time_slice(device, admin) is None
        limits = mps_limits(
            config,
            allotment(device, devices, consumed if share_id else {}) if mps_here else None,
            device_name=name,
            gpu_uuid=device.gpu_uuid,
        )
        mps = plan_mps(limits, gpu_uuid=device.gpu_uuid, cdi_name=cdi_name, site=mps_site)
        prepared = PreparedDevice(
            pool_name=str(result.get("pool")),
            device_name=name,
            request_names=(request.split("/", 1)[0],),
            cdi_device_ids=tuple(cdi_ids(ref.uid, name, share_id)),
            share_id=share_id,
            admin_access=admin,
            # Admin access observes a device another claim may be using: it never
            # creates (or later destroys) a MIG device; it sees the parent GPU.
            mig=None if admin else _mig_intent(device),
            consumed_capacity=tuple(sorted((str(k), str(v)) for k, v in consumed.items()))
            if share_id
            else (),
            time_slice=_time_slice(config, device, admin) if time_slices else None,
            # What the double-booking guard judges this device by while it is held,
            # whatever the node publishes later (driver/state/booking.py).
            hardware=hardware_of(device, devices),
            mps=mps.record if mps is not None else None,
        )
        env = claim_device_env(
            claim_uid=ref.uid,
            device_name=name,
            admin_access=admin,
            sharing=_sharing_env(config),
            consumed_capacity=result.get("consumedCapacity"),
        )
        planned.append(
            PlannedDevice(
                prepared=prepared,
                cdi_name=cdi_name,
                env=(*env, *(mps.env if mps is not None else ())),
                gpu_uuid=device.gpu_uuid,
                gpu_minor=device.gpu_minor,
                mounts=mps.mounts if mps is not None else (),
            )
        )
    _one_mps_device(planned)
    return tuple(planned)


def _one_mps_device(planned: Sequence[PlannedDevice]) -> None:
    """A claim gets at most one device an MPS daemon limits: a container has one
    CUDA_MPS_PIPE_DIRECTORY, so of two daemons mounted there only one would be
    reached, and its server sees only its own GPU (permanent invalid-config)."""
    limited = [p.prepared.device_name for p in planned if p.prepared.mps is not None]
    if len(limited) > 1:
        raise ConfigError(
            [
                (
                    "status.allocation.devices.results",
                    f"devices {', '.join(limited)} would each get an MPS daemon of its own, "
                    "and a container reaches only one (one CUDA_MPS_PIPE_DIRECTORY); ask "
                    "for one MPS-limited device per claim (a share, a partition, "
                    "SpacePartitioning or MPS on a node that runs MPS daemons)",
                )
            ]
        )


def with_mig(planned: PlannedDevice, record: MigRecord) -> PlannedDevice:
    return replace(planned, prepared=replace(planned.prepared, mig=record))


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
            parent = _parent_node(spec, name)
            minor = _gpu_minor(parent)
            if parent is not None and minor is not None:
                caps = _mig_nodes(majors, context, minor, after.mig.gi_id, after.mig.ci_id)
                nodes[name] = (parent, *caps)

    def env(values: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for value in values:
            for before, after in uuids.items():
                value = value.replace(before, after)
            out.append(value)
        return tuple(out)

    devices = tuple(
        CdiDevice(d.name, env(d.env), nodes.get(d.name, d.device_nodes), d.mounts)
        for d in spec.devices
    )
    return ClaimSpec(devices, spec.device_nodes)


def _parent_node(spec: ClaimSpec, name: str) -> DeviceNode | None:
    for device in spec.devices:
        if device.name == name and device.device_nodes:
            return device.device_nodes[0]
    return None


def _gpu_minor(node: DeviceNode | None) -> int | None:
    tail = node.path.removeprefix("/dev/nvidia") if node is not None else ""
    return int(tail) if tail.isdigit() else None
