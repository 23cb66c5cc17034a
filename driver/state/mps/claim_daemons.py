"""MPS control daemons of prepared claims (docs/mps.md, "Lifecycle").

A device prepared with MPS limits gets a daemon of its own, for its GPU alone, in its
directory (driver/state/mps/daemons.py), which its containers mount; the daemon is
told the limits through its control pipe, and the containers' env carries them too
(MPS clients can only lower them). It runs as an `MpsDaemons` of the kind
--mps-daemons names; the other kinds the plugin can reach stop what the journal names
from another setting. Its record is in the `PrepareStarted` entry before it starts
(the intent: no pid, no Deployment), and what identifies it (pid and start time, or
the Deployment's name and UID) in the `PrepareCompleted` entry.

Prepare starts the daemons (`apply`): a whole GPU published strict is put in
EXCLUSIVE_PROCESS first, its mode found recorded before the intent is stored
(`note_compute_modes`, driver/state/mps/compute_modes.py), and a strict partition
joins its GPU's shared daemon (driver/state/mps/shared.py). A rollback (`restore`)
and unprepare (`release`) stop them, whatever --mps-daemons says now. Start
(`adopt`) and, while the plugin runs, the MPS watch (driver/state/mps_watch.py)
start again those that are gone (`revive`), report a daemon pod that Kubernetes
replaced or restarted (`observe`) and remove what no journal entry owns (`sweep`,
driver/state/mps/orphans.py).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from driver.errors import DriverError, transient
from driver.observability import metrics
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.compute_modes import ClaimComputeModes, ComputeModeOps
from driver.state.mps.daemon_changes import MpsLoss, MpsReplaced, change_seen, daemon_text
from driver.state.mps.daemon_plan import MpsSite
from driver.state.mps.daemons import (
    KIND_NODE,
    MpsDaemons,
    daemon_dirs,
    empty_directory,
    make_directories,
    record_kind,
    unsearchable_parent,
)
from driver.state.mps.orphans import Orphan, sweep_orphans
from driver.state.mps.shared import holders, inherited_mode, with_daemon_of
from driver.state.request import PreparableDevice
from driver.state.spec_render import PlannedDevice

log = logging.getLogger(__name__)


class ClaimMps:
    """The MPS side of prepare, unprepare and start. `daemons` None: no MPS on this
    node (no daemon is started). `others`: the kinds of daemon the plugin can still
    stop (those of the other --mps-daemons settings). `compute_modes`: what sets a
    strict GPU's compute mode (None: a device published strict is refused)."""

    def __init__(
        self,
        daemons: MpsDaemons | None,
        root: Path,
        *,
        others: Sequence[MpsDaemons] = (),
        compute_modes: ComputeModeOps | None = None,
    ) -> None:
        self._daemons = daemons
        others = tuple(o for o in others if daemons is None or o.kind != daemons.kind)
        self._kinds = (daemons, *others) if daemons is not None else others
        # What unmounts a daemon's tmpfs, whichever kind started it (the plugin gives
        # every kind the same).
        self._shm = next((d.shm for d in self._kinds if d.shm is not None), None)
        self.root = root
        # Where daemons live, None where there is no MPS (what planning is told).
        self.site = MpsSite(root, daemons.private_shm) if daemons is not None else None
        self._reach_checked = False
        self.compute_modes = ClaimComputeModes(compute_modes)

    def watched(self, record: MpsRecord) -> bool:
        """Is the record's daemon of the kind this node runs now (checked, started
        again)? One started under another setting is left to its claim's unprepare."""
        return self._daemons is not None and record_kind(record) in (None, self._daemons.kind)

    def _start(self, record: MpsRecord, *, prepare: bool) -> MpsRecord:
        """Start the daemon in its directories, made where missing and kept where
        they are (the claim's containers may hold them), with their modes. At
        `prepare` its /dev/shm becomes a tmpfs where the plugin may mount one; a
        daemon started again keeps whatever its clients' containers hold there (a
        tmpfs mounted now would be another /dev/shm than theirs)."""
        daemons = self._daemons
        assert daemons is not None
        dirs = daemon_dirs(self.root, record)
        private = daemons.private_shm
        make_directories(self.root, dirs if private else replace(dirs, shm=None))
        if prepare and private and dirs.shm is not None and daemons.shm is not None:
            daemons.shm.apply(dirs.shm)
        if daemons.kind == KIND_NODE and not self._reach_checked:
            # A node daemon's MPS server runs as its client's uid and reaches its pipe
            # directory by the host's path: say once when a non-root one cannot.
            self._reach_checked = True
            blocked = unsearchable_parent(self.root)
            if blocked is not None:
                log.warning(
                    "with --mps-daemons=node the MPS server of a client that does not run "
                    "as root runs as the client's uid and cannot reach %s: %s is not "
                    "searchable by other users; such clients get no MPS server "
                    '(docs/mps.md, "Directories, users and /dev/shm")',
                    self.root,
                    blocked,
                )
        return daemons.start(record, dirs)

    def _stop(self, record: MpsRecord) -> None:
        """Stop the daemon (the recorded one, or whatever runs in its place for an
        intent: pipe directory, derived Deployment name) by the kind that started it,
        unmount its /dev/shm and remove its directory."""
        kind = record_kind(record)
        stoppers = [d for d in self._kinds if kind is None or d.kind == kind]
        if not stoppers and kind is not None:
            raise transient(
                f"the journal names the MPS daemon {daemon_text(record)} (GPU "
                f"{record.gpu_uuid}), started with --mps-daemons={kind}, and this plugin "
                "cannot stop such a daemon (docs/upgrade.md)"
            )
        dirs = daemon_dirs(self.root, record)
        for daemons in stoppers:
            daemons.stop(record, dirs)
        if self._shm is not None and dirs.shm is not None:
            self._shm.release(dirs.shm)
        shutil.rmtree(self.root / record.directory, ignore_errors=True)

    # -- prepare -----------------------------------------------------------------------

    def note_compute_modes(
        self,
        uid: str,
        planned: Sequence[PlannedDevice],
        devices: Mapping[str, PreparableDevice],
        journal: Mapping[str, ClaimEntry],
    ) -> tuple[PlannedDevice, ...]:
        """Before the intent is stored: each strict device's record notes its GPU's
        compute mode; a shared server's, the mode its first claim found."""
        return self.compute_modes.note(
            planned, devices, lambda record: inherited_mode(journal, record, besides=(uid,))
        )

    def apply(
        self, uid: str, devices: Sequence[PreparedDevice], journal: Mapping[str, ClaimEntry]
    ) -> tuple[PreparedDevice, ...]:
        """Start the daemons of the claim's devices (their intent is durable), a strict
        GPU put in EXCLUSIVE_PROCESS first, or join its GPU's shared daemon where one
        runs; the devices with their records stamped. A failure stops those started
        and puts the modes back (transient error)."""
        out: list[PreparedDevice] = []
        for device in devices:
            record = device.mps
            try:
                if record is not None:
                    running = self._joinable(uid, record, journal)
                    if running is not None:
                        device = replace(device, mps=with_daemon_of(record, running))
                    else:
                        self.compute_modes.make_exclusive(record)
                        try:
                            started = self._start(record, prepare=True)
                        except DriverError as err:
                            raise transient(f"device {device.device_name}: {err}") from err
                        device = replace(device, mps=started)
            except DriverError:
                try:
                    self.restore(uid, [*out, device], journal)
                except DriverError as err:  # the rollback of the entry repeats it
                    log.error("undoing the MPS daemons of device %s: %s", device.device_name, err)
                raise
            out.append(device)
        return tuple(out)

    def _joinable(
        self, uid: str, record: MpsRecord, journal: Mapping[str, ClaimEntry]
    ) -> MpsRecord | None:
        """For a shared record: another claim's record of the GPU's daemon that runs
        (the claim joins it), None where none does (the claim starts it). Raises a
        transient error where it runs with other limits (partitions republished)."""
        if not record.shared:
            return None
        assert self._daemons is not None
        asked: set[tuple[int, int, str]] = set()  # the claims of one daemon share its identity
        for other in holders(journal, record, besides=(uid,)):
            identity = (other.pid, other.start_time, other.deployment_uid)
            intent = not (other.pid or other.deployment_uid)
            if intent or not self.watched(other) or identity in asked:
                continue
            asked.add(identity)  # `alive` is a Deployment GET on Kubernetes: once each
            if not self._daemons.alive(other):
                continue
            limits = (other.active_thread_percentage, other.pinned_memory_bytes)
            if limits != (record.active_thread_percentage, record.pinned_memory_bytes):
                raise transient(
                    f"the MPS server of GPU {record.gpu_uuid} serves its partitions with "
                    f"other limits ({other.active_thread_percentage}%, "
                    f"{other.pinned_memory_bytes} bytes) than this claim's partition; it "
                    "takes new claims once the claims it serves are unprepared"
                )
            return other
        return None

    def restore(
        self,
        uid: str,
        devices: Sequence[PreparedDevice],
        journal: Mapping[str, ClaimEntry],
        *,
        besides: Collection[str] = (),
    ) -> None:
        """Stop every daemon the claim's devices may have started, whatever
        --mps-daemons says now, then put a strict GPU's compute mode back; a shared
        daemon only where no claim but `uid` and `besides` names it. Raises a transient
        error (the caller keeps the entry)."""
        for device in devices:
            record = device.mps
            if record is None or (
                record.shared and any(holders(journal, record, besides=(uid, *besides)))
            ):
                continue  # a shared server goes with its GPU's last claim
            self._stop(record)
            self.compute_modes.restore(record)

    # -- unprepare ---------------------------------------------------------------------

    def release(
        self, journal: Mapping[str, ClaimEntry], uids: Sequence[str]
    ) -> dict[str, DriverError]:
        """Before the entries of `uids` are dropped: stop their daemons. Returns the
        claims whose daemon could not be stopped (they keep their entries)."""
        errors: dict[str, DriverError] = {}
        released: list[str] = []
        for uid in uids:
            try:
                self.restore(uid, journal[uid].devices, journal, besides=released)
            except DriverError as err:
                log.error("unprepare: stopping the MPS daemon of claim %s failed: %s", uid, err)
                errors[uid] = err
            else:
                released.append(uid)
        return errors

    # -- start and while running ---------------------------------------------------------

    def adopt(
        self, journal: dict[str, ClaimEntry], exclude: Collection[str]
    ) -> tuple[list[str], dict[str, tuple[MpsLoss, ...]]]:
        """At start, but for the claims of `exclude` (another instance has them in
        flight): each completed strict claim's GPU in EXCLUSIVE_PROCESS again, each
        completed claim's daemons adopted or, gone, started again (`revive`, its entry
        in `journal` updated). Returns (the claims adopted, per claim whose daemon was
        gone what became of it)."""
        self.compute_modes.reapply(journal, exclude)  # a reboot reset them to Default
        adopted: list[str] = []
        lost: dict[str, tuple[MpsLoss, ...]] = {}
        for uid, entry in sorted(journal.items()):
            if uid in exclude or entry.state is not ClaimState.PREPARE_COMPLETED:
                continue
            if not any(d.mps and self.watched(d.mps) for d in entry.devices):
                continue
            journal[uid], losses = self.revive(uid, entry, journal)
            if losses:
                lost[uid] = losses
            else:
                adopted.append(uid)
        return adopted, lost

    def revive(
        self, uid: str, entry: ClaimEntry, journal: Mapping[str, ClaimEntry]
    ) -> tuple[ClaimEntry, tuple[MpsLoss, ...]]:
        """Under the node lock: the completed claim's daemons that are gone started
        again with their limits, whatever is left in their place stopped first, so new
        clients are limited again (those of the dead daemon lost their GPU work). The
        new daemon serves the directories the claim's containers mount, emptied: never
        new ones at the same paths, which running containers would not see (they would
        run without MPS). Returns the entry with their new records (one that could not
        be started keeps the lost record: it is tried again next time) and what became
        of each."""
        daemons = self._daemons
        assert daemons is not None  # only a claim with a watched daemon is revived
        devices: list[PreparedDevice] = []
        losses: list[MpsLoss] = []
        for device in entry.devices:
            record = device.mps
            if record is None or not self.watched(record) or daemons.alive(record):
                devices.append(device)
                continue
            log.error(
                "the MPS daemon %s of claim %s (GPU %s) is gone; starting it again",
                daemon_text(record),
                uid,
                record.gpu_uuid,
            )
            try:
                running = self._joinable(uid, record, journal)
            except DriverError:
                running = None
            loss = MpsLoss(device.device_name, record)
            if running is not None:  # another claim's check started the GPU's again
                loss = replace(loss, restarted=with_daemon_of(record, running))
            else:
                dirs = daemon_dirs(self.root, record)
                try:
                    daemons.stop(record, dirs, any_instance=True)  # what is left there
                    for kept in (dirs.pipe, dirs.shm):
                        if kept is not None:
                            empty_directory(kept)
                    loss = replace(loss, restarted=self._start(record, prepare=False))
                except DriverError as err:
                    log.error("restarting the MPS daemon of claim %s failed: %s", uid, err)
                    loss = replace(loss, error=str(err))
            losses.append(loss)
            metrics.MPS_DAEMONS_LOST.labels(outcome=loss.outcome).inc()
            devices.append(
                device if loss.restarted is None else replace(device, mps=loss.restarted)
            )
        return replace(entry, devices=tuple(devices)), tuple(losses)

    def observe(self, uid: str, entry: ClaimEntry) -> tuple[ClaimEntry, tuple[MpsReplaced, ...]]:
        """The claim's running daemons as they run now: one whose pod Kubernetes
        replaced or whose container it restarted is reported (its clients lost their
        GPU work). Returns the entry with what was seen (store it when it differs)."""
        assert self._daemons is not None  # only a revived claim is observed
        devices: list[PreparedDevice] = []
        replaced: list[MpsReplaced] = []
        for device in entry.devices:
            record = device.mps
            if record is not None and self.watched(record):
                seen = self._daemons.observe(record)
                change = change_seen(record, seen)
                if change is not None:
                    log.error(
                        "the MPS daemon %s of claim %s (GPU %s) was started again by "
                        "Kubernetes: %s",
                        daemon_text(record),
                        uid,
                        record.gpu_uuid,
                        change,
                    )
                    metrics.MPS_DAEMONS_LOST.labels(outcome="replaced").inc()
                    replaced.append(MpsReplaced(device.device_name, seen, change))
                device = replace(device, mps=seen)
            devices.append(device)
        return replace(entry, devices=tuple(devices)), tuple(replaced)

    def not_ready(self, record: MpsRecord) -> str | None:
        """Why a daemon that is there does not serve (its pod not ready), None if it
        does."""
        assert self._daemons is not None
        return self._daemons.not_ready(record)

    def sweep(self, journal: Mapping[str, ClaimEntry]) -> list[Orphan]:
        """Under the node lock: remove the daemons and directories no entry of
        `journal` owns (driver/state/mps/orphans.py)."""
        return sweep_orphans(self.root, journal, self._kinds, self._shm)
