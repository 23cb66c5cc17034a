"""What the prepare, unprepare and recovery steps share: `StepContext`.

The prepare stages (`driver/state/plan.py`, `apply.py`, `commit.py`), unprepare
(`driver/state/teardown.py`) and start-up recovery
(`driver/state/recovery/startup_recovery.py`) take a `StepContext`; `DeviceState`
(`driver/state/prepare.py`) is the facade on top that the plugin calls.
The context holds the node's stores (journal, CDI specs, MIG and time-slice
operations), the node lock and the claim locks, the calls in flight (`InFlight`), the
remembered permanent verdicts (`VerdictMemory`, KEP-5322: a retried claim is answered
at once, with no API read, no NVML, no disk) and counters, and the two steps every path
takes: loading the journal and failing a claim (its verdict remembered and reported
when permanent).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.cdi.claim_specs import CdiSpecs
from driver.cdi.common_spec import CommonSpec
from driver.cdi.driver_edits import DriverRoot
from driver.errors import DEFAULT_PERMANENT_ERRORS, DriverError, ErrorClass
from driver.state.claim_timeslices import ClaimTimeSlices, TimeSliceOps
from driver.state.journal.checkpoint import Checkpoint, CheckpointCorruptError, ClaimEntry
from driver.state.journal.locking import ClaimLocks, SerializeLock
from driver.state.mig_instances import ClaimInstances, MigOps
from driver.state.mps.claim_daemons import ClaimMps
from driver.state.mps.compute_modes import ComputeModeOps
from driver.state.mps.daemons import MpsDaemons, MpsOps, NodeDaemons
from driver.state.request import (
    ClaimReader,
    ClaimRef,
    DeviceHealth,
    FailureReporter,
    PreparableDevice,
    PrepareResult,
)
from driver.state.spec_render import CdiContext

log = logging.getLogger(__name__)

DEFAULT_VERDICT_TTL: Final = 300.0
DEFAULT_VERDICT_LIMIT: Final = 4096


@dataclass
class _Verdict:
    error: DriverError
    expires: float


class VerdictMemory:
    """Permanent verdicts by claim UID: at most `limit`, each for `ttl` seconds."""

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_VERDICT_TTL,
        limit: int = DEFAULT_VERDICT_LIMIT,
        clock: Callable[[], float],
    ) -> None:
        self._ttl = ttl
        self._limit = limit
        self._clock = clock
        self._verdicts: OrderedDict[str, _Verdict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, uid: str) -> DriverError | None:
        with self._lock:
            verdict = self._verdicts.get(uid)
            if verdict is None:
                return None
            if self._clock() >= verdict.expires:
                del self._verdicts[uid]
                return None
            return verdict.error

    def remember(self, uid: str, err: DriverError) -> None:
        with self._lock:
            self._verdicts[uid] = _Verdict(err, self._clock() + self._ttl)
            self._verdicts.move_to_end(uid)
            while len(self._verdicts) > self._limit:
                self._verdicts.popitem(last=False)

    def forget(self, uids: Iterable[str]) -> None:
        with self._lock:
            for uid in uids:
                self._verdicts.pop(uid, None)


class InFlight:
    """How many prepare/unprepare calls are running. The plugin's clean stop `drain`s
    them (bounded) before it compacts the journal: gRPC's `server.stop(grace)` cancels
    the calls still running, but their handler threads go on."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._running = 0

    @property
    def running(self) -> int:
        with self._idle:
            return self._running

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Counts the block as a call in flight."""
        with self._idle:
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                if not self._running:
                    self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no call is in flight, at most `timeout` seconds; False if some
        still are."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True


@dataclass
class StateStats:
    """Counters for metrics and tests (monotonic, never reset)."""

    verdict_hits: int = 0  # prepares answered from a remembered permanent verdict
    claim_reads: int = 0  # ClaimReader.get calls
    prepared: int = 0  # claims newly prepared (CDI spec + PrepareCompleted written)
    idempotent_hits: int = 0  # prepares answered from a PrepareCompleted entry
    rollbacks: int = 0  # half-done prepares rolled back
    permanent_failures: int = 0  # permanent verdicts reached (not the repeats)
    unprepared: int = 0  # claims whose local state was removed
    checkpoint_corrupt: int = 0  # calls refused because the journal is corrupt


class StepContext:
    """The node's prepare state as the steps see it. Thread-safe where the steps take
    `lock` (and `claim_locks` for what they do outside it); safe across plugin
    instances that share `data_dir` (both are `flock`s in it)."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        devices: Mapping[str, PreparableDevice],
        cdi_root: Path | str,
        data_dir: Path | str,
        claims: ClaimReader,
        health: DeviceHealth,
        reporter: FailureReporter,
        real_devices: bool = False,
        mig: MigOps | None = None,
        caps_root: Path = Path("/"),
        driver_root: DriverRoot | None = None,
        proc_devices: Path = Path("/proc/devices"),
        permanent_errors: Iterable[ErrorClass] = DEFAULT_PERMANENT_ERRORS,
        lock_timeout: float = 10.0,
        verdict_ttl: float = DEFAULT_VERDICT_TTL,
        verdict_limit: int = DEFAULT_VERDICT_LIMIT,
        clock: Callable[[], float] = time.monotonic,
        timeslice: TimeSliceOps | None = None,
        mps: MpsOps | None = None,
        mps_daemons: MpsDaemons | None = None,
        mps_others: Sequence[MpsDaemons] = (),
        compute_modes: ComputeModeOps | None = None,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.devices = devices  # replaced by the plugin once discovery ran
        self.cdi = CdiSpecs(cdi_root, driver_name)
        self.checkpoint = Checkpoint(data_dir)
        self.real_devices = real_devices
        self.context = CdiContext(
            real_devices=real_devices, caps_root=caps_root, proc_devices=proc_devices
        )
        self.common = CommonSpec(
            self.cdi, node_name, driver_root if real_devices else None, proc_devices=proc_devices
        )
        self.instances = ClaimInstances(mig)
        self.timeslices = ClaimTimeSlices(timeslice)
        # `mps_daemons` (the Kubernetes path) or node processes of `mps`'s binary; the
        # other kinds stop what the journal names from another --mps-daemons setting.
        daemons = mps_daemons or (NodeDaemons(mps) if mps is not None else None)
        # `compute_modes`: a strict GPU's EXCLUSIVE_PROCESS (driver/state/mps/compute_modes.py).
        self.mps = ClaimMps(
            daemons, Path(data_dir) / "mps", others=mps_others, compute_modes=compute_modes
        )
        self.permanent_errors = frozenset(permanent_errors)
        self.stats = StateStats()
        self.verdicts = VerdictMemory(ttl=verdict_ttl, limit=verdict_limit, clock=clock)
        self.lock = SerializeLock(data_dir, timeout=lock_timeout)
        self.in_flight = InFlight()  # prepare/unprepare calls, drained at a clean stop
        self.claim_locks = ClaimLocks(data_dir)  # requests in flight outside `lock`
        self._claims = claims
        self.health = health  # replaced by the plugin once discovery ran
        self._reporter = reporter
        # Claims whose unprepare ran while the journal was unreadable: their specs are
        # gone, their MIG devices and entries are owed (`teardown.finish_owed`).
        self.pending_removals: set[str] = set()
        self.last_swept: list[Path] = []
        self._checkpoint_problem: str | None = None

    @property
    def checkpoint_problem(self) -> str | None:
        """Why the journal is currently unusable (corrupt), or None. The plugin exposes
        this (log, metric, health); prepare is refused while it is set."""
        return self._checkpoint_problem

    def load_journal(self) -> dict[str, ClaimEntry]:
        self.last_swept = self.cdi.sweep_temp_files() + self.checkpoint.sweep_temp_files()
        for path in self.last_swept:
            log.warning("removed temp file left by a crash: %s", path)
        try:
            journal = self.checkpoint.load()
        except CheckpointCorruptError as err:
            if self._checkpoint_problem is None:
                log.error("%s", err)
            self._checkpoint_problem = str(err)
            raise
        self._checkpoint_problem = None
        return journal

    def fail(self, ref: ClaimRef, claim: dict[str, Any] | None, err: DriverError) -> PrepareResult:
        if err.permanent and err.error_class not in self.permanent_errors:
            err = DriverError(
                ErrorClass.TRANSIENT,
                f"{err.error_class.value}: {err.message} "
                "(treated as transient: class not in --permanent-errors)",
            )
        if not err.permanent:
            return PrepareResult(error=err)
        self.stats.permanent_failures += 1
        self.verdicts.remember(ref.uid, err)
        log.warning("claim %s/%s (%s): %s", ref.namespace, ref.name, ref.uid, err)
        if claim is not None:
            try:
                self._reporter.permanent_failure(claim, err)
            except Exception:  # visibility is best effort; the verdict stands
                log.exception("reporting the permanent failure of claim %s failed", ref.uid)
        return PrepareResult(error=err)
