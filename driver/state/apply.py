"""Stage 3 of a prepare (driver/state/prepare.py): what a claim changes on the node
outside the data directory. MIG devices are created (by a batch that leaves the node
lock, outside it, holding its claims' locks: a create takes hundreds of milliseconds
to seconds on a real GPU, and a request that needs no NVML call must not wait for it);
the GPUs' time-slice intervals are set and the claims' MPS daemons started. Before
that, half-done entries of claims being redone are rolled back and the MIG intents
note what already sits at their placements. `undo` is the way back, for a claim that
fails later in the pass.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

from driver.errors import DriverError, transient
from driver.failpoints import failpoint
from driver.state.batch import Batch, Work, claim_failure, devices_of, fail_work
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, PreparedDevice
from driver.state.mig_instances import Place, other_entries
from driver.state.plan import PREPARE_STARTED
from driver.state.request import PrepareResult

log = logging.getLogger(__name__)


def clear_the_way(
    state: StepContext,
    batch: Batch,
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> Batch | None:
    """Roll back the batch's found entries, then note each MIG intent's occupants;
    the batch of the claims left (None when none is)."""
    work = batch.work
    if batch.found:
        work = _roll_back_found(state, work, batch.found, journal, results)
    work = _note_occupants(state, work, journal, results)
    return replace(batch, work=work, found={}) if work else None


def create_mig(state: StepContext, batch: Batch) -> None:
    """Create each claim's MIG devices. Needs no node lock: the intent is journaled
    and, where the batch leaves the lock, the claims' locks are held. A claim that
    fails keeps its error (a failed create destroys what it created)."""
    for w in batch.work:
        if w.error is not None or not any(p.prepared.owns_mig for p in w.planned):
            continue
        try:
            w.planned, failure = state.instances.create(w.planned)
            if failure is not None:
                raise failure
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)


def share(state: StepContext, work: Sequence[Work], journal: dict[str, ClaimEntry]) -> None:
    """Under the node lock, with `journal` loaded: set the GPUs' time-slice intervals
    and start the claims' MPS daemons."""
    for w in work:
        if w.error is not None or not w.changes_the_node:
            continue
        try:
            w.planned = state.timeslices.apply(w.ref.uid, w.planned, journal)
            started = state.mps.apply(w.ref.uid, devices_of(w), journal)
            w.planned = tuple(
                replace(p, prepared=d) for p, d in zip(w.planned, started, strict=True)
            )
            journal[w.ref.uid] = w.entry(PREPARE_STARTED)  # a daemon the next claim joins
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)


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
            state.mps.restore(uid, found[uid].devices, journal)
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
    (driver/state/mig_instances.py); each strict MPS device records its GPU's compute
    mode, which a rollback puts back (driver/state/mps/compute_modes.py). After
    `_roll_back_found`, whose destroys free ids a create may reuse and whose restores
    put the modes back. A claim whose GPU cannot be read fails; its found entry,
    rolled back, goes with it."""
    seen: dict[Place, tuple[int, ...]] = {}
    for w in work:
        try:
            if w.changes_the_node:
                w.planned = state.instances.note_occupants(w.planned, seen)
                w.planned = state.mps.note_compute_modes(
                    w.ref.uid, w.planned, state.devices, journal
                )
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)
            journal.pop(w.ref.uid, None)
            continue
        journal[w.ref.uid] = w.entry(PREPARE_STARTED)
    fail_work(state, work, results)
    return [w for w in work if w.error is None]


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
            state.mps.restore(uid, devices_of(w), journal)
        except DriverError as err:
            journal[uid] = w.entry(PREPARE_STARTED)
            log.error("rolling back claim %s failed: %s", uid, err)
            continue
        journal.pop(uid, None)
        undone.add(uid)
    return undone


def still_journaled(
    state: StepContext,
    work: list[Work],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> list[Work]:
    """The claims whose intent the reloaded journal still holds. Every request
    leaves an entry whose claim lock is held alone; only a journal replaced by hand
    (`gpu-dra journal quarantine` with a plugin still running) drops or changes one:
    that claim fails and its MIG devices go, its entry as the journal now has it."""
    lost = [w for w in work if journal.get(w.ref.uid) != w.intent]
    if lost:
        error = transient(
            "the journal changed while the claim's MIG devices were created (replaced "
            "by hand?); its MIG devices were destroyed again, retry"
        )
        others = [entry.devices for entry in journal.values()]
        abandon(state, lost, work, others, error, results)
    return [w for w in work if w not in lost]


def abandon(
    state: StepContext,
    work: Sequence[Work],
    batch: Sequence[Work],
    others: Iterable[Sequence[PreparedDevice]],
    error: DriverError,
    results: dict[str, PrepareResult],
) -> None:
    """Destroy the MIG devices of the claims of `work` (never one `others` or another
    claim of the `batch` records) and fail them with `error`; their journal entries
    are left as they are."""
    held = list(others)
    for w in work:
        batch_others = (devices_of(o) for o in batch if o is not w)
        try:
            state.instances.undo_created(devices_of(w), itertools.chain(held, batch_others))
        except DriverError as err:  # found by its placement at the retry or the next start
            log.error("destroying the MIG devices of claim %s failed: %s", w.ref.uid, err)
        w.error = error
    fail_work(state, work, results)
