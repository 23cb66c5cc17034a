"""Steps 3-4 of a prepare and the start of step 5, under the node lock (the module
doc of driver/state/prepare.py lists them): plan and book each claim, roll back
found half-done entries, then ONE `PrepareStarted` store (the intent). What follows
(the MIG devices, the CDI specs, the GPUs' time-slice intervals and ONE
`PrepareCompleted` store) is in driver/state/completion.py. A claim that fails is
rolled back alone; a failed journal store fails and rolls back the whole batch.

A claim whose own request, or the request of the claim holding its device, is in
flight outside the node lock (its claim lock is held, driver/state/journal/locking.py) is
not planned but `Deferred`: the caller waits for that request, holding no lock, and
plans it again."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from driver.cdi.claim_specs import ClaimSpec
from driver.errors import DriverError, transient
from driver.failpoints import failpoint
from driver.state.booking import HeldError, refuse_double_booking, refuse_over_capacity
from driver.state.claims import ClaimRef, PrepareResult
from driver.state.context import StepContext
from driver.state.instances import Place, other_entries, owns_mig
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.journal.locking import ClaimHolds
from driver.state.planning import CdiContext, PlannedDevice, for_batch, plan_claim
from driver.state.teardown import unprepare_begun

log = logging.getLogger(__name__)

PREPARE_STARTED = ClaimState.PREPARE_STARTED


Todo = Sequence[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]]


@dataclass
class Work:
    """A claim of the current batch that is being written."""

    ref: ClaimRef
    claim: dict[str, Any]
    planned: tuple[PlannedDevice, ...]
    spec: ClaimSpec | None = None
    error: DriverError | None = None
    intent: ClaimEntry | None = None  # its PrepareStarted entry, as journaled

    def entry(self, state: ClaimState) -> ClaimEntry:
        devices = tuple(p.prepared for p in self.planned)
        spec = self.spec if state is ClaimState.PREPARE_COMPLETED else None
        return ClaimEntry(state, self.ref.namespace, self.ref.name, devices, spec)


@dataclass(frozen=True)
class Deferred:
    """A claim planned again once `blocker`'s request in flight is done; `error` is
    its answer if that takes longer than the lock timeout."""

    blocker: str
    error: DriverError


@dataclass
class Batch:
    """The planned claims of a request whose intent is journaled (if it needs one)."""

    work: list[Work]
    context: CdiContext  # how their specs are rendered
    # It creates MIG devices: the NVML calls run outside the node lock, its claims'
    # locks held (`ClaimHolds`), and the journal is read again for the rest.
    leaves_lock: bool


def plan_batch(
    state: StepContext,
    todo: Todo,
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
    holds: ClaimHolds,
) -> tuple[Batch | None, dict[str, Deferred]]:
    """Plan and book the claims of `todo` (read and checked, outside the lock) with
    `journal` loaded under the lock, roll back their found entries and journal the
    intent. Every claim gets its answer in `results`, is `Deferred`, or is in the
    returned batch (None when no claim is left to write)."""
    plans = _plan_each(state, todo, journal, results)
    if plans.unmarked:
        _unmark(state, plans.unmarked, journal, results)
    work, found, deferred = plans.work, plans.found, plans.deferred
    leaves_lock = any(owns_mig(devices_of(w)) for w in work)
    if leaves_lock:
        work = _hold(work, holds, deferred)
        found = {uid: e for uid, e in found.items() if uid not in deferred}
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
    if found:
        work = _roll_back_found(state, work, found, journal, results)
    work = _note_occupants(state, work, journal, results)
    if not work:
        return None, deferred

    failpoint("prepare-before-started")
    if any(_changes_the_node(w) for w in work):
        try:
            # The intent, before MIG devices are created or GPU intervals set. Not
            # synced: a crash of the process keeps the record (page cache), and a
            # power loss, which could lose it, also resets every MIG device and
            # interval.
            state.checkpoint.store(
                journal, before_commit="prepare-started-before-commit", sync=False
            )
        except DriverError as err:
            abort(state, work, journal, results, err)
            return None, deferred
        failpoint("prepare-after-started")
    for w in work:
        w.intent = journal[w.ref.uid]
    return Batch(work, context, leaves_lock), deferred


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


def _changes_the_node(w: Work) -> bool:
    """Does the claim's prepare change state outside the data directory (a MIG device
    to create, a GPU's time-slice interval to set)? Then its intent is journaled
    first; a whole-GPU or partition claim goes straight to `PrepareCompleted`."""
    devices = devices_of(w)
    return owns_mig(devices) or any(d.time_slice is not None or d.mps is not None for d in devices)


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
    )


def _roll_back_found(
    state: StepContext,
    work: list[Work],
    found: dict[str, ClaimEntry],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> list[Work]:
    """Half-done entries of claims being redone: their specs and MIG devices go
    before anything new is written. One that cannot be rolled back stays as it
    was found (the retry or recover() redoes it)."""
    state.stats.rollbacks += len(found)
    log.info("rolling back %d found entries before redoing them", len(found))
    _, errors = state.cdi.remove_claim_specs(sorted(found))
    failpoint("prepare-rollback-after-cdi-removed")
    for w in work:
        uid = w.ref.uid
        if uid not in found:
            continue
        try:
            if uid in errors:
                raise transient(f"rolling back claim {uid}: {errors[uid]}")
            state.instances.destroy(found[uid].devices, other_entries(uid, journal))
            state.timeslices.restore(uid, found[uid].devices, journal, intent=True)
            state.mps.restore(found[uid].devices)
        except DriverError as err:
            journal[uid] = found[uid]
            w.error = err
    fail_work(state, work, results)
    return [w for w in work if w.error is None]


def _note_occupants(
    state: StepContext,
    work: list[Work],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> list[Work]:
    """Each MIG intent records the instances already at its placement (normally none)
    before it is journaled: a rollback destroys only an instance that was not there
    (driver/state/instances.py). After `_roll_back_found`, whose destroys free ids a
    create may reuse. A claim whose GPU cannot be read fails; its found entry, rolled
    back, goes with it."""
    seen: dict[Place, tuple[int, ...]] = {}
    for w in work:
        try:
            w.planned = state.instances.note_occupants(w.planned, seen)
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)
            journal.pop(w.ref.uid, None)
            continue
        journal[w.ref.uid] = w.entry(PREPARE_STARTED)
    fail_work(state, work, results)
    return [w for w in work if w.error is None]


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


def claim_failure(exc: BaseException, uid: str) -> DriverError:
    if isinstance(exc, DriverError):
        return exc
    log.error("prepare of claim %s failed", uid, exc_info=exc)
    return as_transient(exc)


def fail_work(state: StepContext, work: Sequence[Work], results: dict[str, PrepareResult]) -> None:
    for w in work:
        if w.error is not None and w.ref.uid not in results:
            results[w.ref.uid] = state.fail(w.ref, w.claim, w.error)


def undo(
    state: StepContext,
    work: Sequence[Work],
    journal: dict[str, ClaimEntry],
    batch: Sequence[Work] = (),
) -> set[str]:
    """Remove the claims' specs and the MIG devices this process's attempt created,
    by the ids it recorded (never one that another entry or another claim of the
    `batch` records; never what merely sits at an intent's placement: a failed
    create made nothing there); drop the entries of those fully undone.
    The others stay `PrepareStarted`: the retry or recover() finishes."""
    _, errors = state.cdi.remove_claim_specs([w.ref.uid for w in work])
    undone: set[str] = set()
    for w in work:
        uid = w.ref.uid
        try:
            if uid in errors:
                raise transient(str(errors[uid]))
            batch_others = (devices_of(o) for o in batch if o is not w)
            state.instances.undo_created(
                devices_of(w), itertools.chain(other_entries(uid, journal), batch_others)
            )
            state.timeslices.restore(uid, devices_of(w), journal)
            state.mps.restore(devices_of(w))
        except DriverError as err:
            journal[uid] = w.entry(PREPARE_STARTED)
            log.error("rolling back claim %s failed: %s", uid, err)
            continue
        journal.pop(uid, None)
        undone.add(uid)
    return undone


def devices_of(w: Work) -> tuple[PreparedDevice, ...]:
    return tuple(p.prepared for p in w.planned)


def abort(
    state: StepContext,
    work: Sequence[Work],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
    err: DriverError,
) -> None:
    """A journal store failed: fail every claim of the batch and roll them all back
    as far as the disk and NVML let us; whatever is left is a `PrepareStarted`
    entry that the retry or `recover()` rolls back."""
    for w in work:
        w.error = err
    undone = undo(state, work, journal, work)
    fail_work(state, work, results)
    if undone:
        try:
            state.checkpoint.store(journal)
        except DriverError as again:
            log.error("rolling back %d claims failed: %s", len(undone), again)


def as_transient(exc: BaseException) -> DriverError:
    return transient(f"{type(exc).__name__}: {exc}")
