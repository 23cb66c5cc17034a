"""Start-up recovery of the journal, CDI specs, MIG devices and GPU time-slice
intervals, before the plugin serves (docs/state.md, "Recovery rules" and
"Durability"; docs/mig.md, "Crash safety").

The journal is the source of truth: a claim's CDI spec is rewritten when a power loss
took or garbled it, and a spec no entry owns is removed. Failures are per claim: one
whose rollback, MIG device or spec cannot be handled is reported and left as it is;
the plugin starts anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from driver.errors import DriverError, transient
from driver.failpoints import failpoint
from driver.state.context import StepContext
from driver.state.journal.checkpoint import CheckpointCorruptError, ClaimEntry, ClaimState
from driver.state.journal.journal_entries import boot_id, unprepare_begun
from driver.state.mig_instances import other_entries
from driver.state.mps.claim_daemons import MpsLoss
from driver.state.recovery.adoption import adopt_intents
from driver.state.recovery.quarantine import (
    finish_pending_quarantine,
    orphan_log_copy,
    salvage_entries,
)
from driver.state.request import ClaimRef
from driver.state.spec_render import respec_restored
from driver.state.teardown import claim_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryReport:
    """What `DeviceState.recover()` found and did at startup."""

    swept_temp_files: tuple[Path, ...] = ()
    rolled_back: tuple[str, ...] = ()  # PrepareStarted claims rolled back
    # claim specs without a journal entry a quarantined journal knew (kept)
    orphan_specs: tuple[str, ...] = ()
    recreated_specs: tuple[str, ...] = ()  # completed claims whose lost spec was rewritten
    missing_specs: tuple[str, ...] = ()  # completed claims whose spec is gone for good
    checkpoint_problem: str | None = None
    restored_mig: tuple[str, ...] = ()  # completed claims whose MIG devices were recreated
    time_slices: tuple[str, ...] = ()  # GPUs whose time-slice interval was set again
    mps_adopted: tuple[str, ...] = ()  # completed claims whose MPS daemons run on
    mps_lost: tuple[str, ...] = ()  # completed claims whose MPS daemon was gone (restarted)
    # Each of those claims and what became of its daemons (Events once the plugin runs).
    mps_losses: tuple[tuple[ClaimRef, tuple[MpsLoss, ...]], ...] = ()
    # "<claim uid>: <why>" for each entry left as it was (each logged at ERROR): a
    # rollback or a MIG device that failed (a lost GPU, NVML refusing), a spec that
    # could not be written. The plugin starts anyway; the entry keeps its devices.
    problems: tuple[str, ...] = ()
    # completed claims whose interrupted unprepare had begun (`unprepare_begun`): torn down
    finished_unprepares: tuple[str, ...] = ()
    # claim specs without a journal entry, removed (a prepare whose entry never became
    # durable, an unprepare a power loss undid)
    removed_specs: tuple[str, ...] = ()
    # intents a quarantine carried to be adopted, completed from their live MIG
    # devices (driver/state/recovery/adoption.py)
    adopted: tuple[str, ...] = ()


def recover(state: StepContext) -> RecoveryReport:
    """Startup, before the sockets are served (docs/state.md, "Recovery rules"). Never
    raises for a corrupt journal (reported in `checkpoint_problem`)."""
    with state.lock.hold():
        state.common.write()
        try:
            quarantined = finish_pending_quarantine(state.checkpoint)
            if quarantined is not None:
                log.warning("finished the interrupted quarantine of the journal: %s", quarantined)
            journal = state.load_journal()
        except CheckpointCorruptError as err:
            problem = str(err)
            orphan = orphan_log_copy(state.checkpoint.data_dir)
            if orphan is not None and not state.checkpoint.log_path.exists():
                problem += (
                    f"; {orphan.name} is its log, moved aside by an interrupted quarantine: "
                    "gpu-dra journal quarantine reads the two together"
                )
            return RecoveryReport(checkpoint_problem=problem)
        swept = tuple(state.last_swept)
        # Claims whose request another instance (a rolling update) has in flight:
        # their entries are not a crash's leftovers and are left to it.
        busy = set(state.claim_locks.sweep())
        if busy:
            log.info("left %d claim(s) another instance is preparing or unpreparing", len(busy))
        problems: list[str] = []
        adoption = adopt_intents(state, journal, busy)
        adopted = adoption.adopted
        problems += [
            f"{uid}: adoption left for the next start: {why}"
            for uid, why in adoption.deferred.items()
        ]
        # Deferred adoptions are decided by a later start: left as they are meanwhile.
        busy |= set(adoption.deferred)
        rolled_back = _roll_back_started(state, journal, busy, problems)
        specs = state.cdi.list_claim_specs()
        boot = boot_id()
        begun = [
            u
            for u, e in sorted(journal.items())
            if u not in busy and unprepare_begun(e, u in specs, boot)
        ]
        finished = _finish_unprepares(state, journal, begun, problems)
        # Other marks are inert (an unprepare that removed nothing: the kubelet repeats
        # it; a mark of an earlier boot): dropped, so only an unprepare in progress has one.
        inert = [
            u
            for u, e in journal.items()
            if e.unpreparing is not None and u not in begun and u not in busy
        ]
        for uid in inert:
            journal[uid] = replace(journal[uid], unpreparing=None)
        restored = _restore_mig(state, journal, [*begun, *busy], problems)
        time_slices = state.timeslices.reapply(journal)
        mps_adopted, mps_lost = state.mps.adopt(journal, exclude=busy)
        if adopted or rolled_back or restored or finished or inert or mps_lost:
            state.checkpoint.store(journal)
            state.stats.rollbacks += len(rolled_back)
            state.stats.unprepared += len(finished)
        orphans, removed = _sweep_orphan_specs(state, [u for u in specs if u not in journal])
        # Specs not in place as the journal stores them (an entry from before stored
        # specs counts its spec as current while one exists).
        stale = [
            uid
            for uid, entry in sorted(journal.items())
            if uid not in begun
            and uid not in busy
            and not (
                uid in specs
                and (entry.cdi_spec is None or state.cdi.claim_spec_is(uid, entry.cdi_spec))
            )
        ]
        recreated, missing = _recreate_specs(state, stale, journal, problems)
        _compact_journal(state)
    for uid in orphans:
        log.warning(
            "CDI spec of claim %s has no journal entry but a quarantined journal knew the "
            "claim; kept until its unprepare",
            uid,
        )
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
        mps_adopted=tuple(mps_adopted),
        mps_lost=tuple(mps_lost),
        mps_losses=tuple(
            (ClaimRef(journal[uid].namespace, journal[uid].name, uid), losses)
            for uid, losses in mps_lost.items()
        ),
        problems=tuple(problems),
        finished_unprepares=tuple(finished),
        removed_specs=removed,
        adopted=tuple(adopted),
    )


def _sweep_orphan_specs(
    state: StepContext, orphans: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Claim specs no entry owns: written by a prepare whose entry never became
    durable, or left by an unprepare a power loss undid. Removed, except those of
    claims a quarantined journal knew (`checkpoint.json.corrupt-*`): pods prepared
    before the quarantine still run with them, and a container restart needs its
    spec; each goes with its claim's unprepare. Returns (kept, removed)."""
    if not orphans:
        return (), ()
    known = {uid for copy in state.checkpoint.corrupt_copies() for uid in salvage_entries(copy)}
    kept = tuple(uid for uid in orphans if uid in known)
    gone, errors = state.cdi.remove_claim_specs([uid for uid in orphans if uid not in known])
    for uid, err in errors.items():
        log.error("cannot remove the CDI spec of claim %s, which no entry owns: %s", uid, err)
    if gone:
        log.warning("removed %d CDI spec(s) no journal entry owns: %s", len(gone), sorted(gone))
    return kept, tuple(sorted(gone))


def compact_journal(state: StepContext, *, drain_seconds: float) -> None:
    """At a clean stop, once nothing new is served: the prepares and unprepares in
    flight finish (at most `drain_seconds`), then the journal's log is folded into its
    snapshot (schemaVersion 1), so that any release, an older one after a downgrade
    too, reads it (docs/state.md, "The log"). Nothing is stored after that: a call
    still in flight fails at its next journal step (its PrepareStarted entry, if any,
    is rolled back at the next start; an unprepare begun is finished there)."""
    if not state.in_flight.drain(drain_seconds):
        log.warning(
            "%d prepare/unprepare call(s) still in flight after %gs; they fail, and "
            "store nothing after the journal's compaction",
            state.in_flight.running,
            drain_seconds,
        )
    stopping = "the plugin is stopping; the kubelet retries with the next plugin instance"
    try:
        with state.lock.hold():
            _compact_journal(state)
            state.lock.close(stopping)
    except DriverError as err:
        log.warning("could not compact the journal: %s", err)
    state.lock.close(stopping)


def _compact_journal(state: StepContext) -> None:
    """Under the node lock; at start, the fallback for a stop that did not compact. A
    failure only leaves the log to be replayed."""
    try:
        state.checkpoint.compact()
    except DriverError as err:
        log.warning("could not compact the journal: %s", err)


def _problem(problems: list[str], uid: str, what: str, err: Exception) -> None:
    error = claim_error(uid, err)
    log.error("claim %s: %s: %s", uid, what, error)
    problems.append(f"{uid}: {what}: {error}")


def _roll_back_started(
    state: StepContext, journal: dict[str, ClaimEntry], busy: set[str], problems: list[str]
) -> list[str]:
    """A `PrepareStarted` entry whose claim lock nobody holds is from a crash (a
    prepare in flight holds it: `busy`); the kubelet never got a success answer and
    will retry."""
    started = [
        u
        for u, e in sorted(journal.items())
        if e.state is ClaimState.PREPARE_STARTED and u not in busy
    ]
    if not started:
        return []
    _, errors = state.cdi.remove_claim_specs(started)  # specs first
    failpoint("prepare-rollback-after-cdi-removed")
    rolled_back: list[str] = []
    for uid in started:
        try:
            if uid in errors:
                raise transient(str(errors[uid]))
            state.instances.destroy(journal[uid].devices, other_entries(uid, journal))
            state.timeslices.restore(uid, journal[uid].devices, journal, intent=True)
            state.mps.restore(uid, journal[uid].devices, journal)
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
    failed.update(state.mps.release(journal, [u for u in done if u not in failed]))
    for uid, error in failed.items():
        _problem(problems, uid, "finishing its unprepare failed", error)
    finished = [uid for uid in done if uid not in failed]
    for uid in finished:
        del journal[uid]
    if finished:
        log.warning("finished the interrupted unprepare of %d claim(s)", len(finished))
    return finished


def _restore_mig(
    state: StepContext, journal: dict[str, ClaimEntry], skip: Sequence[str], problems: list[str]
) -> list[str]:
    """Completed claims whose MIG devices a reboot destroyed get them again. One that
    cannot (its GPU is lost, NVML refuses) stays as it is: still prepared, its
    devices held, until the kubelet unprepares it. `skip`: claims being torn down
    (an unprepare begun, or in flight in another instance)."""
    restored: list[str] = []
    for uid, entry in sorted(journal.items()):
        if entry.state is not ClaimState.PREPARE_COMPLETED or uid in skip:
            continue
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
    """Rewrite the lost (or partial, or different) CDI specs of completed claims from
    the journal. Returns (recreated, not recreatable)."""
    recreated: list[str] = []
    missing: list[str] = []
    for uid in uids:
        spec = journal[uid].cdi_spec
        if spec is None:
            missing.append(uid)
            continue
        try:
            state.cdi.write_claim_spec(uid, spec)
        except Exception as err:  # the kubelet's next prepare of the claim rewrites it
            _problem(problems, uid, "its CDI spec cannot be rewritten", err)
            continue
        recreated.append(uid)
    if recreated:
        log.info("recreated the CDI specs of %d prepared claim(s)", len(recreated))
    return tuple(recreated), tuple(missing)
