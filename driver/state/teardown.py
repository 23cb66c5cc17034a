"""Unprepare: CDI specs, MIG devices and GPU time-slice intervals of claims, then their
journal entries (docs/state.md, "Recovery rules"; docs/mig.md, "Crash safety").
Start-up recovery lives in driver/state/recovery.py.

Failures are per claim: a claim whose MIG device or spec cannot be handled gets its
own transient error and keeps its entry; the other claims of the request go on. A MIG
device on a lost GPU counts as destroyed (driver/state/instances.py; docs/mig.md, "A
lost GPU")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from driver.errors import DriverError, transient
from driver.state.checkpoint import CheckpointCorruptError, ClaimEntry, ClaimState
from driver.state.claims import ClaimRef, unique
from driver.state.context import StepContext
from driver.state.failpoints import failpoint
from driver.state.instances import other_entries, owns_mig

log = logging.getLogger(__name__)


def unprepare(state: StepContext, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
    state.verdicts.forget(ref.uid for ref in claims)
    results: dict[str, DriverError | None] = {}
    try:
        with state.lock.hold():
            journal: dict[str, ClaimEntry] | None
            try:
                journal = settled_journal(state)
            except CheckpointCorruptError as err:
                state.stats.checkpoint_corrupt += 1
                log.error("%s; unprepare removes CDI specs only", err)
                journal = None
            results.update(_unprepare_batch(state, unique(list(claims)), journal))
    except Exception as exc:  # lock timeout, unreadable journal, a bug
        if not isinstance(exc, DriverError):
            log.exception("unprepare failed")
        error = exc if isinstance(exc, DriverError) else transient(f"{type(exc).__name__}: {exc}")
        for ref in claims:
            results.setdefault(ref.uid, error)
    return results


def settled_journal(state: StepContext) -> dict[str, ClaimEntry]:
    """The journal (`load_journal`), with the unprepares owed from a time it was
    unreadable finished first: each such claim is torn down as its unprepare would
    have done (marked, MIG devices destroyed, GPU intervals restored, entry dropped).
    A claim whose teardown fails keeps its entry, and so its devices, and stays owed:
    the next call tries again."""
    journal = state.load_journal()
    owed = [
        ClaimRef(journal[uid].namespace, journal[uid].name, uid)
        for uid in sorted(state.pending_removals)
        if uid in journal
    ]
    state.pending_removals.clear()
    if owed:
        for uid, err in _unprepare_batch(state, owed, journal).items():
            if err is not None:
                log.error("claim %s: its owed unprepare failed, entry kept: %s", uid, err)
                state.pending_removals.add(uid)
    return journal


def _unprepare_batch(
    state: StepContext, claims: Sequence[ClaimRef], journal: dict[str, ClaimEntry] | None
) -> dict[str, DriverError | None]:
    """Remove every claim's CDI spec (not durably: recovery), destroy its MIG
    devices, then drop the entries in ONE journal store. A claim whose spec or MIG
    device could not be removed keeps its entry (and so its devices) and gets a
    transient error; the kubelet repeats the unprepare."""
    results: dict[str, DriverError | None] = {}
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
        return results
    if journal is not None:
        targets = _mark_unpreparing(state, journal, targets, results)
        if not targets:
            return results

    failpoint("unprepare-before-cdi-removed")
    gone, errors = state.cdi.remove_claim_specs(targets)
    failpoint("unprepare-after-cdi-removed")
    for uid, err in errors.items():
        results[uid] = transient(f"unprepare of claim {uid}: {err}")
    done: list[str] = []
    for uid in (u for u in targets if u in gone):
        entry = journal.get(uid) if journal is not None else None
        try:
            if entry is not None and journal is not None:
                state.instances.destroy(entry.devices, other_entries(uid, journal))
        except Exception as err:  # this claim keeps its entry; the others go on
            results[uid] = claim_error(uid, err)
            continue
        done.append(uid)
    if journal is not None:  # GPUs back to what the remaining claims want, before the store
        failed = state.timeslices.release(journal, done)
        results.update(failed)
        done = [uid for uid in done if uid not in failed]
    if journal is None:
        state.pending_removals.update(done)  # removed once the journal is readable
    else:
        dropped = [uid for uid in done if journal.pop(uid, None) is not None]
        if dropped:
            try:
                state.checkpoint.store(journal, before_rename="unprepare-entry-before-rename")
            except DriverError as err:
                for uid in dropped:
                    results[uid] = err
                done = [uid for uid in done if uid not in dropped]
            else:
                failpoint("unprepare-after-entry-removed")
    for uid in done:
        results[uid] = None
    state.stats.unprepared += len(done)
    return results


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the node's kernel (the same in every container); "" if unknown."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def unprepare_begun(entry: ClaimEntry, spec_exists: bool, boot: str | None = None) -> bool:
    """Had an unprepare of the completed claim begun removing things? Its entry is
    marked in this boot and its spec is gone (an unprepare removes the spec before any
    MIG device). Not after a reboot (which also destroys MIG devices and empties the
    CDI root), nor while the spec exists: the claim is then as prepared (an earlier
    release, which keeps the mark without knowing it, may have prepared it again).
    `boot`: this boot's id, if already read."""
    if entry.state is not ClaimState.PREPARE_COMPLETED or entry.unpreparing is None:
        return False
    return not spec_exists and entry.unpreparing == (boot_id() if boot is None else boot) != ""


def _mark_unpreparing(
    state: StepContext,
    journal: dict[str, ClaimEntry],
    targets: list[str],
    results: dict[str, DriverError | None],
) -> list[str]:
    """Before anything is removed, the completed claims holding MIG devices the driver
    created are marked `unpreparing` with this boot's id (one journal store, no
    directory fsync: a power loss that undoes it also took the MIG devices, and a
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
        and owns_mig(entry.devices)
    ]
    if not marks:
        return targets
    found = {uid: journal[uid] for uid in marks}
    for uid in marks:
        journal[uid] = replace(found[uid], unpreparing=boot)
    try:
        state.checkpoint.store(journal, sync_dir=False)
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
