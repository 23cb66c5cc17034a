"""Steps 3-5 of a prepare, under the node lock (the module doc of
driver/state/prepare.py lists them): plan and book each claim, roll back found
half-done entries, then ONE `PrepareStarted` store, the MIG devices, the CDI specs, the
GPUs' time-slice intervals and ONE `PrepareCompleted` store. A claim that fails here
is rolled back alone; a failed journal store fails and rolls back the whole batch."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from driver.errors import DriverError, transient
from driver.nvml.types import MigInstance
from driver.state.booking import refuse_double_booking, refuse_over_capacity
from driver.state.cdi import ClaimSpec
from driver.state.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.claims import ClaimRef, PrepareResult
from driver.state.context import StepContext
from driver.state.failpoints import failpoint
from driver.state.instances import other_entries, owns_mig
from driver.state.planning import PlannedDevice, for_batch, plan_claim, render_spec
from driver.state.teardown import unprepare_begun

log = logging.getLogger(__name__)

PREPARE_STARTED = ClaimState.PREPARE_STARTED


@dataclass
class _Work:
    """A claim of the current batch that is being written."""

    ref: ClaimRef
    claim: dict[str, Any]
    planned: tuple[PlannedDevice, ...]
    spec: ClaimSpec | None = None
    error: DriverError | None = None

    def entry(self, state: ClaimState) -> ClaimEntry:
        devices = tuple(p.prepared for p in self.planned)
        spec = self.spec if state is ClaimState.PREPARE_COMPLETED else None
        return ClaimEntry(state, self.ref.namespace, self.ref.name, devices, spec)


def prepare_locked(
    state: StepContext,
    todo: Sequence[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> None:
    """Plan, book and write the claims of `todo` (read and checked, outside the lock)
    with `journal` loaded under the lock; every claim's answer goes into `results`."""
    work: list[_Work] = []
    found: dict[str, ClaimEntry] = {}  # pre-existing entries of claims being redone
    planned: dict[str, ClaimEntry] = {}  # the new PrepareStarted entries
    unmarked: dict[str, tuple[ClaimRef, dict[str, Any], ClaimEntry]] = {}
    for ref, claim, driver_results in todo:
        uid = ref.uid
        entry = journal.get(uid)
        if entry is not None and entry.state is ClaimState.PREPARE_COMPLETED:
            try:
                if _spec_in_place(state, uid, entry):
                    state.stats.idempotent_hits += 1
                    results[uid] = PrepareResult(devices=entry.devices)
                    if entry.unpreparing is not None:  # prepared again: no longer torn down
                        unmarked[uid] = (ref, claim, entry)
                    continue
            except OSError as err:
                error = transient(f"cannot rewrite the CDI spec of {uid}: {err}")
                results[uid] = state.fail(ref, claim, error)
                continue
        try:
            w = _Work(ref, claim, _plan(state, ref, claim, driver_results))
            devices = tuple(p.prepared for p in w.planned)
            # Against every journal entry (a found entry of a claim being redone
            # holds its old devices until it is rolled back) and every claim
            # planned before this one in the same request.
            refuse_double_booking(uid, devices, journal, state.devices)
            refuse_double_booking(uid, devices, planned, state.devices)
            refuse_over_capacity(uid, devices, state.devices, journal, planned)
        except Exception as exc:
            results[uid] = state.fail(ref, claim, _error(exc, uid))
            continue
        if entry is not None:
            found[uid] = entry
        planned[uid] = w.entry(PREPARE_STARTED)
        work.append(w)
    if unmarked:
        _unmark(state, unmarked, journal, results)
    if not work:
        return
    try:  # the driver's files, before any container is pointed at them
        state.common.refresh()
        context = for_batch(state.context, state.common.majors)
    except DriverError as err:
        for w in work:
            results[w.ref.uid] = state.fail(w.ref, w.claim, err)
        return
    journal.update(planned)
    if found:
        work = _roll_back_found(state, work, found, journal, results)
        if not work:
            return
    work = _note_occupants(state, work, journal, results)
    if not work:
        return

    failpoint("prepare-before-started")
    if any(_changes_the_node(w) for w in work):
        try:
            # The intent, before MIG devices are created or GPU intervals set. No
            # directory fsync: a crash of the process keeps the rename (page cache),
            # and a power loss, which could lose it, also resets every MIG device and
            # interval.
            state.checkpoint.store(
                journal, before_rename="prepare-started-before-rename", sync_dir=False
            )
        except DriverError as err:
            _abort(state, work, journal, results, err)
            return
        failpoint("prepare-after-started")

    # Specs are not fsynced: the PrepareCompleted entries carry every spec, and
    # recover() rewrites one a power loss took or garbled before the kubelet can use
    # it; a spec whose entry never became durable is removed there (or by the
    # unprepare the kubelet sends for every claim it asked to prepare).
    for w in work:
        try:
            w.planned = tuple(state.instances.create(w.planned))
            w.spec = render_spec(w.planned, context)
            state.cdi.write_claim_spec(w.ref.uid, w.spec, before_rename="prepare-cdi-before-rename")
            w.planned = state.timeslices.apply(w.ref.uid, w.planned, journal)
        except Exception as exc:
            w.error = _error(exc, w.ref.uid)
    failpoint("prepare-after-cdi")

    failed = [w for w in work if w.error is not None]
    if failed:  # specs and MIG devices go now, entries in the PrepareCompleted store
        _undo(state, failed, journal, work)
        _fail_work(state, failed, results)
        work = [w for w in work if w.error is None]
    for w in work:
        journal[w.ref.uid] = w.entry(ClaimState.PREPARE_COMPLETED)
    try:
        state.checkpoint.store(journal, before_rename="prepare-completed-before-rename")
    except DriverError as err:
        _abort(state, work, journal, results, err)
        return
    failpoint("prepare-after-completed")
    for w in work:
        state.stats.prepared += 1
        results[w.ref.uid] = PrepareResult(devices=tuple(p.prepared for p in w.planned))


def _changes_the_node(w: _Work) -> bool:
    """Does the claim's prepare change state outside the data directory (a MIG device
    to create, a GPU's time-slice interval to set)? Then its intent is journaled
    first; a whole-GPU or partition claim goes straight to `PrepareCompleted`."""
    devices = _devices(w)
    return owns_mig(devices) or any(d.time_slice is not None for d in devices)


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
    )


def _roll_back_found(
    state: StepContext,
    work: list[_Work],
    found: dict[str, ClaimEntry],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> list[_Work]:
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
        except DriverError as err:
            journal[uid] = found[uid]
            w.error = err
    _fail_work(state, work, results)
    return [w for w in work if w.error is None]


def _note_occupants(
    state: StepContext,
    work: list[_Work],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> list[_Work]:
    """Each MIG intent records the instances already at its placement (normally none)
    before it is journaled: a rollback destroys only an instance that was not there
    (driver/state/instances.py). After `_roll_back_found`, whose destroys free ids a
    create may reuse. A claim whose GPU cannot be read fails; its found entry, rolled
    back, goes with it."""
    seen: dict[str, list[MigInstance]] = {}
    for w in work:
        try:
            w.planned = state.instances.note_occupants(w.planned, seen)
        except Exception as exc:
            w.error = _error(exc, w.ref.uid)
            journal.pop(w.ref.uid, None)
            continue
        journal[w.ref.uid] = w.entry(PREPARE_STARTED)
    _fail_work(state, work, results)
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
        state.checkpoint.store(journal)
    except DriverError as err:
        for uid, (ref, claim, entry) in unmarked.items():
            journal[uid] = entry
            results[uid] = state.fail(ref, claim, err)


def _error(exc: BaseException, uid: str) -> DriverError:
    if isinstance(exc, DriverError):
        return exc
    log.error("prepare of claim %s failed", uid, exc_info=exc)
    return as_transient(exc)


def _fail_work(
    state: StepContext, work: Sequence[_Work], results: dict[str, PrepareResult]
) -> None:
    for w in work:
        if w.error is not None and w.ref.uid not in results:
            results[w.ref.uid] = state.fail(w.ref, w.claim, w.error)


def _undo(
    state: StepContext,
    work: Sequence[_Work],
    journal: dict[str, ClaimEntry],
    batch: Sequence[_Work] = (),
) -> set[str]:
    """Remove the claims' specs and MIG devices (never one that another entry or
    another claim of the `batch` records); drop the entries of those fully undone.
    The others stay `PrepareStarted`: the retry or recover() finishes."""
    _, errors = state.cdi.remove_claim_specs([w.ref.uid for w in work])
    undone: set[str] = set()
    for w in work:
        uid = w.ref.uid
        try:
            if uid in errors:
                raise transient(str(errors[uid]))
            batch_others = (_devices(o) for o in batch if o is not w)
            state.instances.destroy(
                _devices(w), itertools.chain(other_entries(uid, journal), batch_others)
            )
            state.timeslices.restore(uid, _devices(w), journal)
        except DriverError as err:
            journal[uid] = w.entry(PREPARE_STARTED)
            log.error("rolling back claim %s failed: %s", uid, err)
            continue
        journal.pop(uid, None)
        undone.add(uid)
    return undone


def _devices(w: _Work) -> tuple[PreparedDevice, ...]:
    return tuple(p.prepared for p in w.planned)


def _abort(
    state: StepContext,
    work: Sequence[_Work],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
    err: DriverError,
) -> None:
    """A journal store failed: fail every claim of the batch and roll them all back
    as far as the disk and NVML let us; whatever is left is a `PrepareStarted`
    entry that the retry or `recover()` rolls back."""
    for w in work:
        w.error = err
    undone = _undo(state, work, journal, work)
    _fail_work(state, work, results)
    if undone:
        try:
            state.checkpoint.store(journal)
        except DriverError as again:
            log.error("rolling back %d claims failed: %s", len(undone), again)


def as_transient(exc: BaseException) -> DriverError:
    return transient(f"{type(exc).__name__}: {exc}")
