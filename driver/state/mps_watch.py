"""The MPS daemons of prepared claims, checked while the plugin runs (docs/mps.md,
"Lifecycle").

Every MPS_WATCH_SECONDS (and once at start) a thread of its own checks, under the node
lock, the daemon of every device with an `mps` record of every completed claim that no
request has in flight (its claim lock free) and whose unprepare has not begun (its CDI
spec, which an unprepare removes first, is there). A daemon started under another
--mps-daemons setting is not checked: its claim's unprepare stops it.

- one that is gone is started again (`ClaimMps.revive`, what the plugin's start
  does), and the journal names the new daemon (one store for the check). One that
  cannot be started keeps its record and is tried again after the interval, twice as
  long after each failure up to MPS_RETRY_MAX_SECONDS;
- a Deployment whose pod is not ready (--mps-daemons=kubernetes) is left to
  Kubernetes, which restarts its container or replaces its pod, and reported;
- a pod Kubernetes replaced (a new UID) or whose container it restarted since the
  journal recorded it is a daemon lost too (`ClaimMps.observe`): reported once, the
  journal then names the pod seen.

Each is a Warning Event on the claim (`MPSDaemonLost`, `MPSDaemonNotReady`),
`gpu_dra_mps_daemon_lost_total` by outcome, and the last check in the plugin's
/status (`gpu-dra status`); a daemon that stays unrestartable or not ready is
reported once, not at every check. Then the check sweeps what no journal entry owns
(driver/state/mps/orphans.py), each removal a Node Event (`MPSOrphanRemoved`); with
MPS off the plugin only sweeps, once at start (`sweep`). After each check, outside
the node lock, `after_check` looks at the GPUs of the daemons found for processes
outside MPS (driver/health/mps_escapes.py).

A thread of its own, not a poller of the health monitor: starting a daemon takes
seconds (its Deployment up to 40 s until its pod is ready), and NVML's health events
must not wait for it. Holding the node lock meanwhile is what a prepare that starts a
daemon does too: the node's other prepares and unprepares wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from driver.errors import DriverError
from driver.observability import metrics
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemon_changes import MpsLoss, daemon_text
from driver.state.mps.orphans import Orphan
from driver.state.request import ClaimRef

log = logging.getLogger(__name__)

MPS_WATCH_SECONDS: Final = 30.0
# A claim whose daemon could not be started again is tried again after the interval,
# then twice as long each time up to this: each try holds the node lock (a Deployment
# that does not get ready, 40 s and its deletion), and the node's other prepares wait.
MPS_RETRY_MAX_SECONDS: Final = 600.0
REASON_LOST: Final = "MPSDaemonLost"
REASON_NOT_READY: Final = "MPSDaemonNotReady"
REASON_ORPHAN: Final = "MPSOrphanRemoved"  # a Node Event
THREAD_NAME: Final = "mps-watch"


class ClaimEventSink(Protocol):
    """What the watch needs of `driver.kube.claims.ClaimEvents`."""

    def post(self, claim: ClaimRef, reason: str, message: str) -> None: ...


class AfterCheck(Protocol):
    """What runs after each check, given its daemons: the look for processes outside
    MPS on their GPUs (`driver.health.mps_escapes.MpsEscapes`)."""

    def check(self, shares: Sequence[DaemonState]) -> object: ...


@dataclass(frozen=True)
class DaemonState:
    """One device's daemon as the last check found it."""

    claim: ClaimRef
    device: str
    gpu_uuid: str
    daemon: str  # `pid <pid>` or `Deployment <name>`
    running: bool
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "claim": f"{self.claim.namespace}/{self.claim.name}",
            "claimUID": self.claim.uid,
            "device": self.device,
            "gpuUUID": self.gpu_uuid,
            "daemon": self.daemon,
            "running": self.running,
            "problem": self.problem,
        }


@dataclass(frozen=True)
class MpsCheck:
    """The last check: when (Unix time; None before the first) and every daemon."""

    checked_at: float | None = None
    daemons: tuple[DaemonState, ...] = ()

    def to_json(self) -> dict[str, Any]:
        at = self.checked_at
        stamp = None if at is None else datetime.fromtimestamp(at, UTC)
        return {
            "checkedAt": stamp and stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "daemons": [d.to_json() for d in self.daemons],
        }

    def problems(self) -> list[str]:
        return [
            f"MPS daemon {d.daemon} of claim {d.claim.namespace}/{d.claim.name}, "
            f"device {d.device} (GPU {d.gpu_uuid}): {d.problem}"
            for d in self.daemons
            if not d.running
        ]


_Notice = tuple[ClaimRef, str, str]  # a Warning Event to post: (claim, reason, message)


class MpsWatch:
    """The periodic check (`check`: one round) and its thread (`start`, `stop`)."""

    def __init__(
        self,
        state: StepContext,
        events: ClaimEventSink,
        *,
        interval: float = MPS_WATCH_SECONDS,
        clock: Callable[[], float] = time.time,
        node_events: Callable[[str, str], None] | None = None,
        after_check: AfterCheck | None = None,
    ) -> None:
        self._state = state
        self._after_check = after_check
        self._events = events
        self._node_events = node_events  # (reason, message) on this node's Node
        self._interval = interval
        self._clock = clock
        self._last = MpsCheck()
        # daemon directory -> the outcome last reported for it while it does not run
        # (`failed`, `not-ready`), so that a lasting one is reported once
        self._reported: dict[str, str] = {}
        self._skipped: str | None = None  # why the last check could not run, logged once
        # claim UID -> (failed tries in a row, when to try again) for a daemon that
        # could not be started again
        self._retry: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def last(self) -> MpsCheck:
        return self._last

    def start(self) -> None:
        if self._thread is None:
            log.info("checking the MPS daemons of prepared claims every %gs", self._interval)
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # a bug must not end the watch
                log.exception("checking the MPS daemons failed")
            self._stop.wait(self._interval)

    def report_start(self, lost: Sequence[tuple[ClaimRef, Sequence[MpsLoss]]]) -> None:
        """The daemons the plugin's start found gone (and started again, or not),
        reported as the check reports them: an Event on each claim."""
        notices: list[_Notice] = []
        for claim, losses in lost:
            for loss in losses:
                self._lost(claim, loss, notices)
        for notice in notices:
            self._events.post(*notice)

    def check(self) -> tuple[DaemonState, ...]:
        """One round: every watched daemon checked, a gone one started again, each
        loss reported, what no entry owns swept. The daemons as found (those of the
        last check where the node lock or the journal cannot be had)."""
        notices: list[_Notice] = []
        orphans: list[Orphan] = []
        now = self._clock()
        try:
            with self._state.lock.hold():
                daemons = self._check_locked(notices, orphans, now)
        except DriverError as err:  # lock timeout or closed (a stop), a corrupt journal
            if str(err) != self._skipped:
                log.warning("MPS daemons not checked: %s; trying again", err)
            self._skipped = str(err)
            return self._last.daemons
        self._skipped = None
        self._last = MpsCheck(now, daemons)
        for notice in notices:
            self._events.post(*notice)
        self._post_orphans(orphans)
        if self._after_check is not None:  # outside the node lock
            self._after_check.check(daemons)
        return daemons

    def sweep(self) -> None:
        """Only the sweep (MPS off: nothing to check, what was left from before to
        remove)."""
        try:
            with self._state.lock.hold():
                orphans = self._state.mps.sweep(self._state.load_journal())
        except DriverError as err:
            log.warning("MPS daemons not swept: %s", err)
            return
        self._post_orphans(orphans)

    def _post_orphans(self, orphans: Sequence[Orphan]) -> None:
        if self._node_events is not None:
            for orphan in orphans:
                self._node_events(
                    REASON_ORPHAN, f"removed {orphan.what}: no prepared claim owns it"
                )

    def _watched(self, uid: str, entry: ClaimEntry) -> bool:
        state = self._state
        return (
            entry.state is ClaimState.PREPARE_COMPLETED
            and any(d.mps and state.mps.watched(d.mps) for d in entry.devices)
            and uid not in state.pending_removals
            and not state.claim_locks.busy(uid)
            and state.cdi.claim_spec_exists(uid)
        )

    def _check_locked(
        self, notices: list[_Notice], orphans: list[Orphan], now: float
    ) -> tuple[DaemonState, ...]:
        state = self._state
        journal = state.load_journal()
        daemons: list[DaemonState] = []
        changed = False
        for uid, entry in sorted(journal.items()):
            if not self._watched(uid, entry):
                continue
            failures, retry_at = self._retry.get(uid, (0, now))
            if now < retry_at:  # as the last check found them
                daemons += [d for d in self._last.daemons if d.claim.uid == uid]
                continue
            claim = ClaimRef(entry.namespace, entry.name, uid)
            updated, losses = state.mps.revive(uid, entry, journal)
            by_directory = {loss.lost.directory: loss for loss in losses}
            if any(loss.restarted is None for loss in losses):
                delay = min(self._interval * 2**failures, MPS_RETRY_MAX_SECONDS)
                self._retry[uid] = (failures + 1, now + delay)
            else:
                self._retry.pop(uid, None)
            updated, replaced = state.mps.observe(uid, updated)
            notices += [
                (
                    claim,
                    REASON_LOST,
                    f"the MPS daemon of device {r.device} (GPU {r.record.gpu_uuid}), "
                    f"{daemon_text(r.record)}: {r.change}, so its clients, if any, lost their "
                    "GPU work; Kubernetes started it again with its limits",
                )
                for r in replaced
            ]
            if updated != entry:  # a daemon started again, a pod seen anew
                journal[uid] = updated
                changed = True
            for device in updated.devices:
                if device.mps is None or not state.mps.watched(device.mps):
                    continue
                loss = by_directory.get(device.mps.directory)
                if loss is not None:
                    daemons.append(self._lost(claim, loss, notices))
                else:
                    daemons.append(self._alive(claim, device.device_name, device.mps, notices))
        if changed:
            state.checkpoint.store(journal)
        watched = {d.mps.directory for e in journal.values() for d in e.devices if d.mps}
        self._reported = {k: v for k, v in self._reported.items() if k in watched}
        self._retry = {k: v for k, v in self._retry.items() if k in journal}
        orphans += state.mps.sweep(journal)
        return tuple(daemons)

    def _lost(self, claim: ClaimRef, loss: MpsLoss, notices: list[_Notice]) -> DaemonState:
        device = loss.device
        record = loss.lost
        what = (
            f"the MPS daemon of device {device} (GPU {record.gpu_uuid}), "
            f"{daemon_text(record)}, is gone (its clients, if any, lost their GPU work)"
        )
        if loss.restarted is not None:
            self._reported.pop(record.directory, None)
            started = daemon_text(loss.restarted)
            notices.append(
                (claim, REASON_LOST, f"{what}; started again ({started}) with its limits")
            )
            return DaemonState(claim, device, record.gpu_uuid, started, True)
        problem = f"gone; could not be started again: {loss.error}"
        if self._reported.get(record.directory) != loss.outcome:
            self._reported[record.directory] = loss.outcome
            notices.append(
                (
                    claim,
                    REASON_LOST,
                    f"{what}; it could not be started again (tried again later, less often "
                    f"after each failure): {loss.error}",
                )
            )
        return DaemonState(claim, device, record.gpu_uuid, daemon_text(record), False, problem)

    def _alive(
        self, claim: ClaimRef, device: str, record: MpsRecord, notices: list[_Notice]
    ) -> DaemonState:
        why = self._state.mps.not_ready(record)
        if why is None:
            self._reported.pop(record.directory, None)
            return DaemonState(claim, device, record.gpu_uuid, daemon_text(record), True)
        if self._reported.get(record.directory) != "not-ready":
            self._reported[record.directory] = "not-ready"
            metrics.MPS_DAEMONS_LOST.labels(outcome="not-ready").inc()
            log.error(
                "the MPS daemon %s of claim %s (GPU %s) does not serve: %s",
                daemon_text(record),
                claim.uid,
                record.gpu_uuid,
                why,
            )
            notices.append(
                (
                    claim,
                    REASON_NOT_READY,
                    f"the MPS daemon of device {device} (GPU {record.gpu_uuid}), "
                    f"{daemon_text(record)}: {why}; Kubernetes restarts it",
                )
            )
        return DaemonState(claim, device, record.gpu_uuid, daemon_text(record), False, why)
