"""Unprepare, and start-up recovery of the journal, CDI specs, MIG devices and GPU
time-slice intervals (docs/state.md, "Recovery rules"; docs/mig.md, "Crash safety")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from driver.errors import DriverError, transient
from driver.state.checkpoint import CheckpointCorruptError, ClaimEntry, ClaimState
from driver.state.claims import ClaimRef, unique
from driver.state.failpoints import failpoint
from driver.state.planning import respec_restored

if TYPE_CHECKING:
    from driver.state.prepare import DeviceState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryReport:
    """What `DeviceState.recover()` found and did at startup."""

    swept_temp_files: tuple[Path, ...] = ()
    rolled_back: tuple[str, ...] = ()  # PrepareStarted claims rolled back
    orphan_specs: tuple[str, ...] = ()  # claim specs without a journal entry (kept)
    recreated_specs: tuple[str, ...] = ()  # completed claims whose lost spec was rewritten
    missing_specs: tuple[str, ...] = ()  # completed claims whose spec is gone for good
    checkpoint_problem: str | None = None
    restored_mig: tuple[str, ...] = ()  # completed claims whose MIG devices were recreated
    time_slices: tuple[str, ...] = ()  # GPUs whose time-slice interval was set again


def unprepare(state: DeviceState, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
    state.verdicts.forget(ref.uid for ref in claims)
    results: dict[str, DriverError | None] = {}
    try:
        with state.lock.hold():
            journal: dict[str, ClaimEntry] | None
            try:
                journal = state.load_journal()
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


def _unprepare_batch(
    state: DeviceState, claims: Sequence[ClaimRef], journal: dict[str, ClaimEntry] | None
) -> dict[str, DriverError | None]:
    """Remove every claim's CDI spec (one fsync of the CDI root), destroy its MIG
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

    failpoint("unprepare-before-cdi-removed")
    gone, errors = state.cdi.remove_claim_specs(targets)
    failpoint("unprepare-after-cdi-removed")
    for uid, err in errors.items():
        results[uid] = transient(f"unprepare of claim {uid}: {err}")
    done: list[str] = []
    for uid in (u for u in targets if u in gone):
        entry = journal.get(uid) if journal is not None else None
        try:
            if entry is not None:
                state.instances.destroy(entry.devices)
        except DriverError as err:
            results[uid] = err
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


def recover(state: DeviceState) -> RecoveryReport:
    """Startup: (re)write the common CDI spec; remove crash leftovers (temp files,
    `PrepareStarted` entries with their specs and half-created MIG devices); recreate
    the MIG devices of completed claims that a reboot destroyed, and every lost CDI
    spec; report orphans. Never raises for a corrupt journal (reported in the result
    and `checkpoint_problem`). Runs before the sockets are served."""
    with state.lock.hold():
        state.common.write()
        try:
            journal = state.load_journal()
        except CheckpointCorruptError as err:
            return RecoveryReport(checkpoint_problem=str(err))
        swept = tuple(state.last_swept)
        rolled_back = _roll_back_started(state, journal)
        restored = _restore_mig(state, journal)
        time_slices = state.timeslices.reapply(journal)
        if rolled_back or restored:
            state.checkpoint.store(journal)
            state.stats.rollbacks += len(rolled_back)
        specs = state.cdi.list_claim_specs()
        orphans = tuple(uid for uid in specs if uid not in journal)
        lost = [uid for uid in sorted(journal) if uid not in specs]
        recreated, missing = _recreate_specs(state, lost, journal)
    for uid in orphans:
        log.warning("CDI spec for claim %s has no journal entry; kept until unprepare", uid)
    for uid in missing:
        log.warning(
            "CDI spec of prepared claim %s is gone and its journal entry predates stored "
            "specs; the kubelet's next prepare of it redoes it",
            uid,
        )
    return RecoveryReport(
        swept, tuple(rolled_back), orphans, recreated, missing, None, tuple(restored), time_slices
    )


def _roll_back_started(state: DeviceState, journal: dict[str, ClaimEntry]) -> list[str]:
    """Under the lock no prepare is in flight, so a `PrepareStarted` entry is from a
    crash; the kubelet never got a success answer and will retry."""
    started = [u for u, e in sorted(journal.items()) if e.state is ClaimState.PREPARE_STARTED]
    if not started:
        return []
    _, errors = state.cdi.remove_claim_specs(started)  # specs first: one fsync
    failpoint("prepare-rollback-after-cdi-removed")
    rolled_back: list[str] = []
    for uid in started:
        try:
            if uid in errors:
                raise transient(str(errors[uid]))
            state.instances.destroy(journal[uid].devices)
            state.timeslices.restore(uid, journal[uid].devices, journal, intent=True)
        except DriverError as err:  # the entry keeps holding its devices
            log.error("rolling back claim %s failed: %s", uid, err)
            continue
        del journal[uid]
        rolled_back.append(uid)
    return rolled_back


def _restore_mig(state: DeviceState, journal: dict[str, ClaimEntry]) -> list[str]:
    restored: list[str] = []
    for uid, entry in sorted(journal.items()):
        if entry.state is not ClaimState.PREPARE_COMPLETED:
            continue
        try:
            devices = state.instances.restore(entry.devices)
        except DriverError as err:
            log.error("claim %s: its MIG devices cannot be restored: %s", uid, err)
            continue
        if devices is None:
            continue
        spec = entry.cdi_spec
        if spec is not None:
            spec = respec_restored(spec, entry.devices, devices, state.context)
            if state.cdi.claim_spec_exists(uid):
                state.cdi.write_claim_spec(uid, spec)
        journal[uid] = replace(entry, devices=devices, cdi_spec=spec)
        restored.append(uid)
    return restored


def _recreate_specs(
    state: DeviceState, uids: Sequence[str], journal: dict[str, ClaimEntry]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Rewrite the lost CDI specs of completed claims from the journal (one fsync
    of the CDI root). Returns (recreated, not recreatable)."""
    recreated: list[str] = []
    missing: list[str] = []
    for uid in uids:
        spec = journal[uid].cdi_spec
        if spec is None:
            missing.append(uid)
            continue
        state.cdi.write_claim_spec(uid, spec, sync_dir=False)
        recreated.append(uid)
    if recreated:
        state.cdi.sync_root()
        log.info("recreated the CDI specs of %d prepared claim(s)", len(recreated))
    return tuple(recreated), tuple(missing)
