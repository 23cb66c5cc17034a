"""Unprepare, and start-up recovery of the journal, CDI specs, MIG devices and GPU
time-slice intervals (docs/state.md, "Recovery rules"; docs/mig.md, "Crash safety").

Failures are per claim: a claim whose MIG device or spec cannot be handled gets its
own transient error (unprepare) or is reported and left as it is (`recover()`); the
other claims of the request go on. A MIG device on a lost GPU counts as destroyed
(driver/state/instances.py; docs/mig.md, "A lost GPU")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from driver.errors import DriverError, transient
from driver.state.checkpoint import CheckpointCorruptError, ClaimEntry, ClaimState
from driver.state.claims import ClaimRef, unique
from driver.state.context import StepContext
from driver.state.failpoints import failpoint
from driver.state.instances import other_entries, owns_mig
from driver.state.planning import respec_restored

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
    # "<claim uid>: <why>" for each entry left as it was (each logged at ERROR): a
    # rollback or a MIG device that failed (a lost GPU, NVML refusing), a spec that
    # could not be written. The plugin starts anyway; the entry keeps its devices.
    problems: tuple[str, ...] = ()
    # completed claims whose interrupted unprepare had begun (`unprepare_begun`): torn down
    finished_unprepares: tuple[str, ...] = ()


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
            results[uid] = _claim_error(uid, err)
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


def recover(state: StepContext) -> RecoveryReport:
    """Startup: (re)write the common CDI spec; remove crash leftovers (temp files,
    `PrepareStarted` entries with their specs and half-created MIG devices); finish the
    teardown of completed claims whose unprepare had begun in this boot; recreate the
    MIG devices of completed claims that a reboot destroyed, and every lost CDI spec;
    report orphans. Never raises for a corrupt journal (reported in the result
    and `checkpoint_problem`). Runs before the sockets are served."""
    with state.lock.hold():
        state.common.write()
        try:
            journal = state.load_journal()
        except CheckpointCorruptError as err:
            return RecoveryReport(checkpoint_problem=str(err))
        swept = tuple(state.last_swept)
        problems: list[str] = []
        rolled_back = _roll_back_started(state, journal, problems)
        specs = state.cdi.list_claim_specs()
        boot = boot_id()
        begun = [u for u, e in sorted(journal.items()) if unprepare_begun(e, u in specs, boot)]
        finished = _finish_unprepares(state, journal, begun, problems)
        # Other marks are inert (an unprepare that removed nothing: the kubelet repeats
        # it; a mark of an earlier boot): dropped, so only an unprepare in progress has one.
        inert = [u for u, e in journal.items() if e.unpreparing is not None and u not in begun]
        for uid in inert:
            journal[uid] = replace(journal[uid], unpreparing=None)
        restored = _restore_mig(state, journal, begun, problems)
        time_slices = state.timeslices.reapply(journal)
        if rolled_back or restored or finished or inert:
            state.checkpoint.store(journal)
            state.stats.rollbacks += len(rolled_back)
            state.stats.unprepared += len(finished)
        orphans = tuple(uid for uid in specs if uid not in journal)
        lost = [uid for uid in sorted(journal) if uid not in specs and uid not in begun]
        recreated, missing = _recreate_specs(state, lost, journal, problems)
    for uid in orphans:
        log.warning("CDI spec for claim %s has no journal entry; kept until unprepare", uid)
    for uid in missing:
        log.warning(
            "CDI spec of prepared claim %s is gone and its journal entry predates stored "
            "specs; the kubelet's next prepare of it redoes it",
            uid,
        )
    return RecoveryReport(
        swept,
        tuple(rolled_back),
        orphans,
        recreated,
        missing,
        None,
        tuple(restored),
        time_slices,
        problems=tuple(problems),
        finished_unprepares=tuple(finished),
    )


def _claim_error(uid: str, err: Exception) -> DriverError:
    if isinstance(err, DriverError):
        return err
    log.error("claim %s failed", uid, exc_info=err)  # a bug: the claim gets a transient error
    return transient(f"claim {uid}: {type(err).__name__}: {err}")


def _problem(problems: list[str], uid: str, what: str, err: Exception) -> None:
    error = _claim_error(uid, err)
    log.error("claim %s: %s: %s", uid, what, error)
    problems.append(f"{uid}: {what}: {error}")


def _roll_back_started(
    state: StepContext, journal: dict[str, ClaimEntry], problems: list[str]
) -> list[str]:
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
            state.instances.destroy(journal[uid].devices, other_entries(uid, journal))
            state.timeslices.restore(uid, journal[uid].devices, journal, intent=True)
        except Exception as err:  # the entry keeps holding its devices
            _problem(problems, uid, "rolling back its prepare failed", err)
            continue
        del journal[uid]
        rolled_back.append(uid)
    return rolled_back


def _finish_unprepares(
    state: StepContext, journal: dict[str, ClaimEntry], begun: Sequence[str], problems: list[str]
) -> list[str]:
    """Completed claims whose unprepare had begun (`unprepare_begun`): the kubelet asked
    to unprepare them (their pods are gone) and the answer never came. Their teardown
    is finished as unprepare does it (MIG devices, GPU time-slice intervals, entry; the
    spec is gone); the kubelet's repeat then finds nothing to do. One that fails stays
    as it is, for that repeat."""
    done: list[str] = []
    for uid in begun:
        try:
            state.instances.destroy(journal[uid].devices, other_entries(uid, journal))
        except Exception as err:  # the entry keeps holding its devices
            _problem(problems, uid, "finishing its unprepare failed", err)
            continue
        done.append(uid)
    failed = state.timeslices.release(journal, done)
    for uid, error in failed.items():
        _problem(problems, uid, "finishing its unprepare failed", error)
    finished = [uid for uid in done if uid not in failed]
    for uid in finished:
        del journal[uid]
    if finished:
        log.warning("finished the interrupted unprepare of %d claim(s)", len(finished))
    return finished


def _restore_mig(
    state: StepContext, journal: dict[str, ClaimEntry], begun: Sequence[str], problems: list[str]
) -> list[str]:
    """Completed claims whose MIG devices a reboot destroyed get them again. One that
    cannot (its GPU is lost, NVML refuses) stays as it is: still prepared, its
    devices held, until the kubelet unprepares it."""
    restored: list[str] = []
    for uid, entry in sorted(journal.items()):
        if entry.state is not ClaimState.PREPARE_COMPLETED or uid in begun:
            continue  # (begun: one that could not be finished; the kubelet's repeat does)
        try:
            devices = state.instances.restore(entry.devices)
            if devices is None:
                continue
            spec = entry.cdi_spec
            if spec is not None:
                spec = respec_restored(spec, entry.devices, devices, state.context)
                if state.cdi.claim_spec_exists(uid):
                    state.cdi.write_claim_spec(uid, spec)
        except Exception as err:
            _problem(problems, uid, "its MIG devices cannot be restored", err)
            continue
        journal[uid] = replace(entry, devices=devices, cdi_spec=spec)
        restored.append(uid)
    return restored


def _recreate_specs(
    state: StepContext, uids: Sequence[str], journal: dict[str, ClaimEntry], problems: list[str]
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
        try:
            state.cdi.write_claim_spec(uid, spec, sync_dir=False)
        except Exception as err:  # the kubelet's next prepare of the claim rewrites it
            _problem(problems, uid, "its CDI spec cannot be rewritten", err)
            continue
        recreated.append(uid)
    if recreated:
        state.cdi.sync_root()
        log.info("recreated the CDI specs of %d prepared claim(s)", len(recreated))
    return tuple(recreated), tuple(missing)
