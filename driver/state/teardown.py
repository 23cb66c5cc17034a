"""Unprepare: CDI specs, MIG devices and GPU time-slice intervals of claims, then their
journal entries (docs/state.md, "Recovery rules"; docs/mig.md, "Crash safety").
Start-up recovery lives in driver/state/recovery/startup_recovery.py.

Failures are per claim: a claim whose MIG device or spec cannot be handled gets its
own transient error and keeps its entry; the other claims of the request go on. A MIG
device on a lost GPU counts as destroyed (driver/state/mig_instances.py; docs/mig.md, "A
lost GPU")."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from driver.errors import DriverError, transient
from driver.failpoints import failpoint
from driver.state.context import StepContext
from driver.state.journal.checkpoint import CheckpointCorruptError, ClaimEntry, ClaimState
from driver.state.journal.journal_entries import boot_id, unprepare_begun
from driver.state.journal.locking import ClaimHolds
from driver.state.mig_instances import other_entries
from driver.state.request import ClaimRef, unique

log = logging.getLogger(__name__)


def unprepare(state: StepContext, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
    state.verdicts.forget(ref.uid for ref in claims)
    results: dict[str, DriverError | None] = {}
    todo = unique(claims)
    deadline = time.monotonic() + state.lock.timeout
    while todo:
        busy = _unprepare_round(state, todo, results)
        todo = [ref for ref in todo if ref.uid in busy]
        if todo and not state.claim_locks.wait_free(busy, deadline):
            for ref in todo:
                results[ref.uid] = transient(
                    f"another prepare or unprepare of claim {ref.uid} is still in progress "
                    "on this node"
                )
            break
    return results


def _unprepare_round(
    state: StepContext, claims: Sequence[ClaimRef], results: dict[str, DriverError | None]
) -> set[str]:
    """Unprepare the claims no request in flight holds (their claim lock is free);
    returns the others, which wait for it holding no lock and come again. A request
    that destroys MIG devices does that outside the node lock, its claims' locks
    held, and takes the node lock again for the journal store."""
    busy: set[str] = set()
    removal: _Removal | None = None
    with state.claim_locks.round() as holds:
        try:
            with state.lock.hold():
                journal = _journal_or_none(state)
                if journal is not None:
                    busy = {
                        r.uid for r in claims if r.uid in journal and state.claim_locks.busy(r.uid)
                    }
                ready = [r for r in claims if r.uid not in busy]
                removal = _begin(state, ready, journal, results, holds, busy)
                if removal is not None and not removal.leaves_lock:
                    _destroy(state, removal, results)
                    _end(state, removal, journal, results)
            if removal is not None and removal.leaves_lock:
                _destroy(state, removal, results)  # NVML, without the node lock
                with state.lock.hold():
                    _end(state, removal, _journal_or_none(state), results)
        except Exception as exc:  # lock timeout, unreadable journal, a bug
            if isinstance(exc, DriverError):
                error = exc
            else:
                log.exception("unprepare failed")
                error = transient(f"{type(exc).__name__}: {exc}")
            for ref in claims:
                if ref.uid not in busy:
                    results.setdefault(ref.uid, error)
    return busy


def _journal_or_none(state: StepContext) -> dict[str, ClaimEntry] | None:
    """The settled journal, or None while it is corrupt (unprepare then removes CDI
    specs only and owes the rest)."""
    try:
        journal = state.load_journal()
    except CheckpointCorruptError as err:
        state.stats.checkpoint_corrupt += 1
        log.error("%s; unprepare removes CDI specs only", err)
        return None
    finish_owed(state, journal)
    return journal


def finish_owed(state: StepContext, journal: dict[str, ClaimEntry]) -> None:
    """Finish the unprepares owed, before a prepare or unprepare uses the loaded
    `journal` (their entries leave it): those of a time it was unreadable, and those
    begun and not finished (`unprepare_begun`: an unprepare of this boot removed the
    spec; one of this process that failed half way, or another instance's that could
    not drop the entry - the release before the log cannot write this journal). Each
    such claim is torn down as its unprepare would have done (MIG devices destroyed,
    GPU intervals restored, entry dropped), so its placement is free at once. A claim
    whose teardown fails, or whose claim lock a request in flight holds, keeps its
    entry, and so its devices, and stays owed: the next call tries again."""
    boot = boot_id()
    begun = {
        uid
        for uid, entry in journal.items()
        if entry.unpreparing is not None
        and unprepare_begun(entry, state.cdi.claim_spec_exists(uid), boot)
    }
    owed = [
        ClaimRef(journal[uid].namespace, journal[uid].name, uid)
        for uid in sorted(state.pending_removals | begun)
        if uid in journal and not state.claim_locks.busy(uid)
    ]
    state.pending_removals.difference_update(ref.uid for ref in owed)
    state.pending_removals.intersection_update(journal)
    if owed:
        results: dict[str, DriverError | None] = {}
        removal = _begin(state, owed, journal, results)
        if removal is not None:
            _destroy(state, removal, results)
            _end(state, removal, journal, results)
        for uid, err in results.items():
            if err is not None:
                log.error("claim %s: its owed unprepare failed, entry kept: %s", uid, err)
                state.pending_removals.add(uid)


@dataclass
class _Removal:
    """Claims of an unprepare whose CDI specs are gone, between the spec removal and
    the journal store."""

    claims: list[str]
    journal: dict[str, ClaimEntry] | None  # as it was then (None: corrupt)
    leaves_lock: bool  # MIG devices to destroy, outside the node lock
    done: list[str] = field(default_factory=list)  # what `_destroy` finished


def _begin(
    state: StepContext,
    claims: Sequence[ClaimRef],
    journal: dict[str, ClaimEntry] | None,
    results: dict[str, DriverError | None],
    holds: ClaimHolds | None = None,
    busy: set[str] | None = None,
) -> _Removal | None:
    """Mark the claims with owned MIG devices `unpreparing` and remove every claim's
    CDI spec (not durably: recovery). With `holds`, a request with MIG devices to
    destroy takes its claims' locks (one another request took meanwhile goes into
    `busy`) and leaves the node lock for the destroys; without, it stays."""
    targets: list[str] = []
    for ref in claims:
        uid = ref.uid
        if (journal is None or uid not in journal) and not state.cdi.claim_spec_exists(uid):
            if journal is None:
                state.pending_removals.add(uid)
            results[uid] = None  # unknown or already unprepared: nothing to write
        else:
            targets.append(uid)
    if not targets:
        return None
    leaves_lock = holds is not None and any(
        journal is not None and uid in journal and any(d.owns_mig for d in journal[uid].devices)
        for uid in targets
    )
    if holds is not None and busy is not None and leaves_lock:
        taken = [uid for uid in targets if holds.take(uid)]
        busy.update(set(targets) - set(taken))
        targets = taken
    if journal is not None:
        targets = _mark_unpreparing(state, journal, targets, results)
    if not targets:
        return None

    failpoint("unprepare-before-cdi-removed")
    gone, errors = state.cdi.remove_claim_specs(targets)
    failpoint("unprepare-after-cdi-removed")
    for uid, err in errors.items():
        results[uid] = transient(f"unprepare of claim {uid}: {err}")
    return _Removal([uid for uid in targets if uid in gone], journal, leaves_lock)


def _destroy(state: StepContext, removal: _Removal, results: dict[str, DriverError | None]) -> None:
    """Destroy the claims' owned MIG devices (never one another entry records). A
    claim whose device cannot be destroyed keeps its entry and gets the error."""
    journal = removal.journal
    for uid in removal.claims:
        entry = journal.get(uid) if journal is not None else None
        try:
            if journal is not None and entry is not None and any(d.owns_mig for d in entry.devices):
                state.instances.destroy(entry.devices, other_entries(uid, journal))
        except Exception as err:  # this claim keeps its entry; the others go on
            results[uid] = claim_error(uid, err)
            continue
        removal.done.append(uid)


def _end(
    state: StepContext,
    removal: _Removal,
    journal: dict[str, ClaimEntry] | None,
    results: dict[str, DriverError | None],
) -> None:
    """Under the node lock, with `journal` loaded: put the GPUs' intervals back and
    drop the entries of the claims torn down in ONE journal store. A claim whose
    interval cannot be restored, or whose entry the store failed to drop, keeps it."""
    done = removal.done
    if journal is None:
        state.pending_removals.update(done)  # removed once the journal is readable
    else:  # GPUs back to what the remaining claims want, before the store
        # A plain or MIG-only claim's unprepare enters neither time-slice nor MPS code.
        shared = [
            u for u in done if u in journal and any(d.shares_the_gpu for d in journal[u].devices)
        ]
        if shared:
            failed = state.timeslices.release(journal, shared)
            failed.update(state.mps.release(journal, [u for u in shared if u not in failed]))
            results.update(failed)
            done = [uid for uid in done if uid not in failed]
        dropped = [uid for uid in done if journal.pop(uid, None) is not None]
        if dropped:
            try:
                state.checkpoint.store(journal, before_commit="unprepare-entry-before-commit")
            except DriverError as err:
                for uid in dropped:
                    results[uid] = err
                done = [uid for uid in done if uid not in dropped]
            else:
                failpoint("unprepare-after-entry-removed")
    for uid in done:
        results[uid] = None
    state.stats.unprepared += len(done)


def _mark_unpreparing(
    state: StepContext,
    journal: dict[str, ClaimEntry],
    targets: list[str],
    results: dict[str, DriverError | None],
) -> list[str]:
    """Before anything is removed, the completed claims holding MIG devices the driver
    created are marked `unpreparing` with this boot's id (one journal store, not
    synced: a power loss that undoes it also took the MIG devices, and a
    restart without the mark restores them as before). A restart then finishes their
    teardown instead of creating their MIG devices again. A failed store fails those
    claims, nothing removed; the others go on. Returns the claims to unprepare."""
    boot = boot_id()
    if not boot:
        return targets  # no mark can be judged: a restart restores as before
    marks = [
        uid
        for uid in targets
        if (entry := journal.get(uid)) is not None
        and entry.state is ClaimState.PREPARE_COMPLETED
        and entry.unpreparing != boot
        and any(d.owns_mig for d in entry.devices)
    ]
    if not marks:
        return targets
    found = {uid: journal[uid] for uid in marks}
    for uid in marks:
        journal[uid] = replace(found[uid], unpreparing=boot)
    try:  # nothing rolls a mark back: no room kept for that (ROLLBACK_RESERVE)
        state.checkpoint.store(journal, sync=False, rollback_reserve=False)
    except DriverError as err:
        journal.update(found)
        for uid in marks:
            results[uid] = err
        return [uid for uid in targets if uid not in found]
    return targets


def claim_error(uid: str, err: Exception) -> DriverError:
    if isinstance(err, DriverError):
        return err
    log.error("claim %s failed", uid, exc_info=err)  # a bug: the claim gets a transient error
    return transient(f"claim {uid}: {type(err).__name__}: {err}")
