"""Stage 2 of a prepare (driver/state/prepare.py): plan and book each claim of a
request, under the node lock, with the journal loaded; nothing is written here.

`plan_claim` resolves a claim's configs and checks the device rules (no NVML, no
disk), and yields one `PlannedDevice` per allocated device: the journal's
`PreparedDevice` (with the MIG intent where a MIG device must be created, the GPU's
time-slice interval, the MPS daemon) and the device's env and mounts. `plan_each`
does it for every claim of the request: a completed claim is answered from the
journal; the others are booked against every journal entry and every claim planned
before them (driver/state/booking.py), or `Deferred` when a request in flight outside
the lock holds the claim or its device (they wait for it, holding no lock, and are
planned again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from driver.cdi.claim_specs import CdiHook, cdi_device_name
from driver.cdi.memory_limit_hook import MemoryLimitSite, memory_share_bytes
from driver.config import (
    ConfigError,
    GpuConfig,
    Interval,
    Strategy,
    resolve_configs,
    validate_for_device,
)
from driver.errors import DriverError, transient
from driver.state.batch import Batch, Deferred, Work, claim_failure, devices_of
from driver.state.booking import HeldError, hardware_of, refuse_double_booking, refuse_over_capacity
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, MigRecord, PreparedDevice
from driver.state.journal.journal_entries import unprepare_begun
from driver.state.journal.locking import ClaimHolds
from driver.state.journal.timeslice_record import TimeSliceRecord
from driver.state.mps.daemon_plan import MpsSite, plan_device_mps
from driver.state.request import ClaimRef, PreparableDevice, PrepareResult
from driver.state.spec_render import PlannedDevice, SharingEnv, claim_device_env, for_batch

log = logging.getLogger(__name__)

PREPARE_STARTED = ClaimState.PREPARE_STARTED

Todo = Sequence[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]]


def _sharing_env(config: GpuConfig) -> SharingEnv:
    return SharingEnv(
        strategy=config.strategy.value,
        interval=config.interval.value if config.interval is not None else None,
        partition_count=config.partition_count,
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
    """The interval to set on the device's GPU (driver/state/claim_timeslices.py): TimeSlicing
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
    memory_limits: MemoryLimitSite | None = None,
) -> tuple[PlannedDevice, ...]:
    """Raises ConfigError (permanent invalid-config) or a transient error. Device
    health is checked before (`check_health`), outside the node lock. `time_slices`:
    the backend sets time-slice intervals, so they are recorded. `mps_site`: where
    MPS daemons live, None on a node without MPS (driver/state/mps/claim_daemons.py).
    `memory_limits`: where memory shares become cgroup limits (a hook per device that
    has one; driver/cdi/memory_limit_hook.py), None where no GPU's driver has them."""
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
        # MPS serves a GPU with MIG off, never with admin access (observing).
        site = mps_site if _no_time_slice(device, admin) is None else None
        mps = (
            plan_device_mps(config, device, devices, consumed if share_id else {}, cdi_name, site)
            if site is not None or config.strategy == Strategy.MPS
            else None
        )
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
                hooks=_memory_limit_hooks(
                    memory_limits, ref.uid, device.gpu_uuid, prepared, consumed
                ),
            )
        )
    _one_mps_device(planned)
    return tuple(planned)


def _memory_limit_hooks(
    site: MemoryLimitSite | None,
    claim_uid: str,
    gpu_uuid: str,
    prepared: PreparedDevice,
    consumed: Mapping[str, Any],
) -> tuple[CdiHook, ...]:
    """The device's memory-limit hook: a GPU with MIG off (NVML takes no MIG device
    handle; a MIG device's memory is its own) with a memory share, not observed."""
    if site is None or prepared.mig is not None or prepared.admin_access:
        return ()
    share = memory_share_bytes(
        pinned_memory_bytes=prepared.mps.pinned_memory_bytes if prepared.mps else None,
        share_id=prepared.share_id,
        consumed=consumed,
    )
    return site.hooks(claim_uid, gpu_uuid, share)


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


def plan_batch(
    state: StepContext,
    todo: Todo,
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
    holds: ClaimHolds,
) -> tuple[Batch | None, dict[str, Deferred]]:
    """Plan and book the claims of `todo` (read and checked, outside the lock) with
    `journal` loaded under the lock; their `PrepareStarted` entries go into `journal`
    (not yet stored). Every claim gets its answer in `results`, is `Deferred`, or is
    in the returned batch (None when no claim is left to write)."""
    plans = _plan_each(state, todo, journal, results)
    if plans.unmarked:
        _unmark(state, plans.unmarked, journal, results)
    work, deferred = plans.work, plans.deferred
    leaves_lock = any(d.owns_mig for w in work for d in devices_of(w))
    if leaves_lock:
        work = _hold(work, holds, deferred)
    if not work:
        return None, deferred
    try:  # the driver's files, before any container is pointed at them
        state.common.refresh()
        context = for_batch(state.context, state.common.majors)
    except DriverError as err:
        for w in work:
            results[w.ref.uid] = state.fail(w.ref, w.claim, err)
        return None, deferred
    journal.update({w.ref.uid: plans.planned[w.ref.uid] for w in work})
    found = {uid: e for uid, e in plans.found.items() if uid not in deferred}
    return Batch(work, context, leaves_lock, found), deferred


@dataclass
class _Plans:
    """The claims of a request after planning and booking, before anything is written."""

    work: list[Work] = field(default_factory=list)
    found: dict[str, ClaimEntry] = field(default_factory=dict)  # entries of claims redone
    planned: dict[str, ClaimEntry] = field(default_factory=dict)  # their PrepareStarted
    # completed claims answered as stored whose `unpreparing` mark goes
    unmarked: dict[str, tuple[ClaimRef, dict[str, Any], ClaimEntry]] = field(default_factory=dict)
    deferred: dict[str, Deferred] = field(default_factory=dict)


def _plan_each(
    state: StepContext,
    todo: Todo,
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> _Plans:
    """Per claim: answer a completed one from the journal, else plan and book it, or
    defer it behind the request in flight that holds it or its device."""
    plans = _Plans()
    for ref, claim, driver_results in todo:
        uid = ref.uid
        entry = journal.get(uid)
        if entry is not None and state.claim_locks.busy(uid):
            plans.deferred[uid] = Deferred(uid, in_flight(uid))
            continue
        if entry is not None and entry.state is ClaimState.PREPARE_COMPLETED:
            try:
                if _spec_in_place(state, uid, entry):
                    state.stats.idempotent_hits += 1
                    results[uid] = PrepareResult(devices=entry.devices)
                    if entry.unpreparing is not None:  # prepared again: no longer torn down
                        plans.unmarked[uid] = (ref, claim, entry)
                    continue
            except OSError as err:
                error = transient(f"cannot rewrite the CDI spec of {uid}: {err}")
                results[uid] = state.fail(ref, claim, error)
                continue
        try:
            w = Work(ref, claim, _plan(state, ref, claim, driver_results))
            devices = devices_of(w)
            # Against every journal entry (a found entry of a claim being redone
            # holds its old devices until it is rolled back) and every claim
            # planned before this one in the same request.
            refuse_double_booking(uid, devices, journal, state.devices)
            refuse_double_booking(uid, devices, plans.planned, state.devices)
            refuse_over_capacity(uid, devices, state.devices, journal, plans.planned)
        except HeldError as err:
            if err.holder not in plans.planned and state.claim_locks.busy(err.holder):
                plans.deferred[uid] = Deferred(err.holder, err)  # freed or refused once done
            else:
                results[uid] = state.fail(ref, claim, err)
            continue
        except Exception as exc:
            results[uid] = state.fail(ref, claim, claim_failure(exc, uid))
            continue
        if entry is not None:
            plans.found[uid] = entry
        plans.planned[uid] = w.entry(PREPARE_STARTED)
        plans.work.append(w)
    return plans


def in_flight(uid: str) -> DriverError:
    return transient(
        f"another prepare or unprepare of claim {uid} is still in progress on this node"
    )


def _hold(work: list[Work], holds: ClaimHolds, deferred: dict[str, Deferred]) -> list[Work]:
    """The claim locks of a batch that leaves the node lock, taken before anything is
    written; a claim whose lock another request took meanwhile is deferred."""
    kept: list[Work] = []
    for w in work:
        if holds.take(w.ref.uid):
            kept.append(w)
        else:
            deferred[w.ref.uid] = Deferred(w.ref.uid, in_flight(w.ref.uid))
    return kept


def _plan(
    state: StepContext, ref: ClaimRef, claim: dict[str, Any], driver_results: list[dict[str, Any]]
) -> tuple[PlannedDevice, ...]:
    return plan_claim(
        ref,
        claim,
        driver_results,
        driver_name=state.driver_name,
        devices=state.devices,
        cdi_ids=state.cdi.device_ids,
        time_slices=state.timeslices.enabled,
        mps_site=state.mps.site,
        memory_limits=state.context.memory_limits,
    )


def _spec_in_place(state: StepContext, uid: str, entry: ClaimEntry) -> bool:
    """Is the completed claim's CDI spec on disk, rewritten from the journal if it
    was lost? False for an entry without a stored spec, and for one whose unprepare
    had begun (its MIG devices may be gone): then it is redone."""
    if state.cdi.claim_spec_exists(uid):
        return True
    if entry.cdi_spec is None or unprepare_begun(entry, spec_exists=False):
        return False
    state.cdi.write_claim_spec(uid, entry.cdi_spec)
    log.warning("rewrote the lost CDI spec of prepared claim %s from the journal", uid)
    return True


def _unmark(
    state: StepContext,
    unmarked: dict[str, tuple[ClaimRef, dict[str, Any], ClaimEntry]],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> None:
    """Completed claims answered as stored whose entry still carries an `unpreparing`
    mark (an unprepare that removed nothing, or a mark of an earlier boot): the mark
    goes, in one store, so a later restart never tears a claim in use down."""
    for uid, (_, _, entry) in unmarked.items():
        journal[uid] = replace(entry, unpreparing=None)
    try:
        state.checkpoint.store(journal, rollback_reserve=False)  # nothing to roll back
    except DriverError as err:
        for uid, (ref, claim, entry) in unmarked.items():
            journal[uid] = entry
            results[uid] = state.fail(ref, claim, err)
