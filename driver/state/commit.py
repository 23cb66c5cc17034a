"""Stages 4 and 5 of a prepare (driver/state/prepare.py): the CDI specs written,
then the journal. A batch that changes the node (a MIG device to create, a GPU's
time-slice interval, an MPS daemon) stores its intent, every claim's `PrepareStarted`
entry in ONE store, before stage 3; every batch ends with ONE store of its
`PrepareCompleted` entries (MIG ids, UUIDs and the spec content), whose directory
fsync is the only one of the pass. A claim that failed on the way is undone alone and
its entry dropped in that store; a failed store fails and undoes the whole batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from driver.errors import DriverError
from driver.failpoints import failpoint
from driver.state.apply import undo
from driver.state.batch import Batch, Work, claim_failure, devices_of, fail_work
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState
from driver.state.request import PrepareResult
from driver.state.spec_render import render_spec

log = logging.getLogger(__name__)


def store_intent(
    state: StepContext,
    batch: Batch,
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> Batch | None:
    """The intent, before MIG devices are created or GPU intervals set: the batch,
    or None when its store failed (every claim failed and undone)."""
    failpoint("prepare-before-started")
    if any(w.changes_the_node for w in batch.work):
        try:
            # Not synced: a crash of the process keeps the record (page cache), and a
            # power loss, which could lose it, also resets every MIG device and
            # interval.
            state.checkpoint.store(
                journal, before_commit="prepare-started-before-commit", sync=False
            )
        except DriverError as err:
            abort(state, batch.work, journal, results, err)
            return None
        failpoint("prepare-after-started")
    for w in batch.work:
        w.intent = journal[w.ref.uid]
    return batch


def write_specs(state: StepContext, batch: Batch, work: Sequence[Work]) -> None:
    """Render and write each claim's CDI spec. Specs are not fsynced: the
    `PrepareCompleted` entries carry every spec, and recover() rewrites one a power
    loss took or garbled before the kubelet can use it; a spec whose entry never
    became durable is removed there (or by the unprepare the kubelet sends for every
    claim it asked to prepare)."""
    for w in work:
        if w.error is not None:
            continue
        try:
            w.spec = render_spec(w.planned, batch.context)
            state.cdi.write_claim_spec(w.ref.uid, w.spec, before_rename="prepare-cdi-before-rename")
        except Exception as exc:
            w.error = claim_failure(exc, w.ref.uid)
    failpoint("prepare-after-cdi")


def complete(
    state: StepContext,
    work: Sequence[Work],
    journal: dict[str, ClaimEntry],
    results: dict[str, PrepareResult],
) -> None:
    """Undo the claims that failed, store the `PrepareCompleted` entries of the
    others and answer each claim in `results`."""
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
