"""The rest of step 5 of a prepare, after the intent (the module doc of
driver/state/prepare.py lists the steps): the MIG devices, the CDI specs, the GPUs'
time-slice intervals and ONE `PrepareCompleted` store.

A batch that creates MIG devices (`Batch.leaves_lock`) creates them outside the node
lock, holding its claims' locks: on a real GPU a create takes hundreds of
milliseconds to seconds, and a request that needs no NVML call must not wait for it.
It then takes the node lock again, reads the journal again (other requests stored
theirs meanwhile) and does the rest there. Any other batch does it all in the hold
that planned it. The order on disk is the same either way, so a crash at any
failpoint leaves what it always left (docs/state.md, "Recovery rules").
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

from driver.errors import DriverError, transient
from driver.failpoints import failpoint
from driver.state.batch import (
    Batch,
    Work,
    abort,
    as_transient,
    claim_failure,
    devices_of,
    fail_work,
    undo,
)
from driver.state.claims import PrepareResult
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.planning import render_spec
from driver.state.teardown import settled_journal

log = logging.getLogger(__name__)


def create_devices(state: StepContext, batch: Batch) -> None:
    """Create each claim's MIG devices and render its spec. Needs no node lock: the
    intent is journaled and the claims' locks are held. A claim that fails keeps its
    error for `complete_batch` (a failed create destroys what it created)."""
    for w in batch.work:
        try:
            w.planned, failure = state.instances.create(w.planned)
            if failure is not None:
                raise failure
            w.spec = render_spec(w.planned, batch.context)
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)


def complete_batch(
    state: StepContext,
    batch: Batch,
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> None:
    """Under the node lock, with `journal` loaded: write the specs, set the GPUs'
    intervals, start the MPS daemons, roll back the claims that failed and store the
    `PrepareCompleted` entries. Every claim gets its answer in `results`."""
    work = batch.work
    if batch.leaves_lock:
        work = _still_journaled(state, work, journal, results)
    # Specs are not fsynced: the PrepareCompleted entries carry every spec, and
    # recover() rewrites one a power loss took or garbled before the kubelet can use
    # it; a spec whose entry never became durable is removed there (or by the
    # unprepare the kubelet sends for every claim it asked to prepare).
    for w in work:
        if w.error is not None or w.spec is None:
            continue
        try:
            state.cdi.write_claim_spec(w.ref.uid, w.spec, before_rename="prepare-cdi-before-rename")
            w.planned = state.timeslices.apply(w.ref.uid, w.planned, journal)
            started = state.mps.apply(devices_of(w))
            w.planned = tuple(
                replace(p, prepared=d) for p, d in zip(w.planned, started, strict=True)
            )
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)
    failpoint("prepare-after-cdi")

    failed = [w for w in work if w.error is not None]
    if failed:  # specs and MIG devices go now, entries in the PrepareCompleted store
        undo(state, failed, journal, work)
        fail_work(state, failed, results)
        work = [w for w in work if w.error is None]
    for w in work:
        journal[w.ref.uid] = w.entry(ClaimState.PREPARE_COMPLETED)
    try:
        state.checkpoint.store(journal, before_commit="prepare-completed-before-commit")
    except DriverError as err:
        abort(state, work, journal, results, err)
        return
    failpoint("prepare-after-completed")
    for w in work:
        state.stats.prepared += 1
        results[w.ref.uid] = PrepareResult(devices=devices_of(w))


def finish_outside_lock(
    state: StepContext, batch: Batch, results: dict[str, PrepareResult]
) -> None:
    """A batch that left the node lock after its intent: create its MIG devices,
    then complete it under the lock. If the lock or the journal cannot be had, its
    MIG devices are destroyed again and every claim fails; its `PrepareStarted`
    entries are rolled back by the kubelet's retry or the next start."""
    create_devices(state, batch)
    try:
        with state.lock.hold():
            complete_batch(state, batch, settled_journal(state), results)
    except Exception as exc:
        if not isinstance(exc, DriverError):
            log.exception("completing a prepare failed")
        error = exc if isinstance(exc, DriverError) else as_transient(exc)
        _abandon(state, batch.work, batch.work, (), error, results)


def _still_journaled(
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
        _abandon(state, lost, work, others, error, results)
    return [w for w in work if w not in lost]


def _abandon(
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
