"""Prepare ResourceClaims on this node (docs/state.md, docs/mig.md).

`DeviceState` is transport-free: the gRPC servicer hands it `ClaimRef`s and turns the
results into protobuf; the Kubernetes API, device health, failure reporting and the
MIG lifecycle come in as small protocols (driver/state/claims.py, instances.py).

`prepare` of a request (a batch of claims) does:

1. per claim, a remembered permanent verdict for the UID is answered again at once (no
   API read, no NVML, no disk access, not even the lock file);
2. per claim, outside the node lock: read it (a batch with several reads in
   flight); its UID must match, it must be
   allocated, to this node, with results for this driver (failures: transient); its
   devices must be healthy (a failed device is tainted - the wait for the API server
   happens here, so an API outage never stalls other claims - then permanent
   device-failed);
3. under the serialize lock, with the journal loaded, per claim: a `PrepareCompleted`
   entry is answered as before (idempotent; a lost CDI spec is rewritten from the
   journal); otherwise plan it (configs -> invalid-config; device rules) and refuse
   hardware another entry holds (driver/state/booking.py);
4. found entries of planned claims (half-done prepares) are rolled back: CDI specs
   removed (one directory fsync), their MIG devices destroyed;
5. ONE journal store with every planned claim's `PrepareStarted` entry (MIG devices
   named by placement: the intent) -> the MIG devices created -> every CDI spec
   (temp file, fsync, rename) -> ONE journal store with the `PrepareCompleted` entries
   (MIG ids, UUIDs and the spec content), whose directory fsync is the only one.

A claim that fails in steps 4-5 is rolled back alone (spec removed, MIG devices
destroyed, entry dropped in the next store); only a failed journal store fails the
whole batch, which is then rolled back. Steps 3-5 live in driver/state/batch.py,
unprepare and start-up recovery in driver/state/teardown.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.errors import DriverError, ErrorClass, transient
from driver.nvml.types import Inventory
from driver.observability import metrics
from driver.state import teardown
from driver.state.batch import as_transient, prepare_locked
from driver.state.cdi import CdiSpecs
from driver.state.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
)
from driver.state.claims import (
    ClaimReader,
    ClaimRef,
    DeviceHealth,
    FailureReporter,
    PreparableDevice,
    PrepareResult,
    check_claim,
    read_claims,
    unique,
)
from driver.state.common_spec import CommonSpec
from driver.state.driver_edits import DriverRoot
from driver.state.instances import ClaimInstances, Held, MigOps, owned_instances
from driver.state.locking import SerializeLock
from driver.state.planning import CdiContext, check_health
from driver.state.teardown import RecoveryReport
from driver.state.timeslice import ClaimTimeSlices, TimeSliceOps
from driver.state.verdicts import (
    DEFAULT_PERMANENT_ERRORS,
    DEFAULT_VERDICT_LIMIT,
    DEFAULT_VERDICT_TTL,
    VerdictMemory,
)

log = logging.getLogger(__name__)


@dataclass
class StateStats:
    """Counters for metrics and tests (monotonic, never reset)."""

    verdict_hits: int = 0  # prepares answered from a remembered permanent verdict
    claim_reads: int = 0  # ClaimReader.get calls
    prepared: int = 0  # claims newly prepared (CDI spec + PrepareCompleted written)
    idempotent_hits: int = 0  # prepares answered from a PrepareCompleted entry
    rollbacks: int = 0  # half-done prepares rolled back
    permanent_failures: int = 0  # permanent verdicts reached (not the repeats)
    transient_failures: int = 0
    unprepared: int = 0  # claims whose local state was removed
    checkpoint_corrupt: int = 0  # calls refused because the journal is corrupt


class DeviceState:
    """Prepare/unprepare for one node. Thread-safe; safe across plugin instances that
    share `data_dir` (serialised by `<data_dir>/serialize.lock`)."""

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
        self.permanent_errors = frozenset(permanent_errors)
        self.stats = StateStats()
        self.verdicts = VerdictMemory(ttl=verdict_ttl, limit=verdict_limit, clock=clock)
        self.lock = SerializeLock(data_dir, timeout=lock_timeout)
        self._claims = claims
        self.health = health  # replaced by the plugin once discovery ran
        self._reporter = reporter
        # Journal removals owed by unprepares that ran while the journal was unreadable.
        self.pending_removals: set[str] = set()
        self.last_swept: list[Path] = []
        self._checkpoint_problem: str | None = None

    # -- public ------------------------------------------------------------------------

    @property
    def checkpoint_problem(self) -> str | None:
        """Why the journal is currently unusable (corrupt), or None. The plugin exposes
        this (log, metric, health); prepare is refused while it is set."""
        return self._checkpoint_problem

    def remembered_verdict(self, uid: str) -> DriverError | None:
        return self.verdicts.get(uid)

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare every claim; one result per UID, never raises for a claim's failure."""
        results: dict[str, PrepareResult] = {}
        todo: list[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]] = []
        to_read: list[ClaimRef] = []
        for ref in unique(list(claims)):
            remembered = self.verdicts.get(ref.uid)
            if remembered is not None:
                self.stats.verdict_hits += 1
                metrics.PERMANENT_VERDICT_REPLAYS.labels(
                    error_class=remembered.error_class.value
                ).inc()
                results[ref.uid] = PrepareResult(error=remembered)
            else:
                to_read.append(ref)
        self.stats.claim_reads += len(to_read)
        for ref, claim in zip(to_read, read_claims(self._claims, to_read), strict=True):
            if isinstance(claim, DriverError):
                results[ref.uid] = self.fail(ref, None, claim)
                continue
            try:
                mine = check_claim(
                    ref, claim, driver_name=self.driver_name, node_name=self.node_name
                )
                check_health(ref, mine, self.health)  # may wait for the API: not locked
                todo.append((ref, claim, mine))
            except DriverError as err:
                results[ref.uid] = self.fail(ref, claim, err)
            except Exception as err:  # a malformed claim must never crash the call
                log.exception("checking claim %s/%s failed", ref.namespace, ref.name)
                results[ref.uid] = self.fail(ref, claim, transient(f"internal error: {err}"))
        if not todo:
            return results

        try:
            with self.lock.hold():
                journal = self.load_journal()
                prepare_locked(self, todo, journal, results)
        except Exception as exc:  # lock timeout, unreadable/corrupt journal, a bug
            if isinstance(exc, CheckpointCorruptError):
                self.stats.checkpoint_corrupt += 1
            if not isinstance(exc, DriverError):
                log.exception("prepare failed")
            error = exc if isinstance(exc, DriverError) else as_transient(exc)
            for ref, claim, _ in todo:
                if ref.uid not in results:
                    results[ref.uid] = self.fail(ref, claim, error)
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
        """Remove each claim's local state. Never permanent; unknown claims succeed."""
        return teardown.unprepare(self, claims)

    def recover(self) -> RecoveryReport:
        """Start-up reconciliation of the journal, the CDI specs and the MIG devices."""
        return teardown.recover(self)

    def owned_mig(self, inventory: Inventory | None = None) -> Held:
        """(GPU UUID, GPU-instance id) of every MIG device the journal owns: a
        completed claim's, and with `inventory` the one a `PrepareStarted` intent's
        attempt may have created (`instances.owned_instances`). With a corrupt journal
        nothing is known to be owned: every MIG device counts as foreign, so none is
        ever destroyed or overlapped until the journal is repaired."""
        with self.lock.hold():
            return self._owned_locked(inventory)

    def discover_with_owned(self, discover: Callable[[], Inventory]) -> tuple[Inventory, Held]:
        """`discover()` and `owned_mig()` of one moment, both under the node lock: a
        plugin instance still serving (a rolling update) cannot create or destroy a
        MIG device between the listing and the journal snapshot."""
        with self.lock.hold():
            inventory = discover()
            return inventory, self._owned_locked(inventory)

    def _owned_locked(self, inventory: Inventory | None) -> Held:
        try:
            journal = self.checkpoint.load()
        except CheckpointCorruptError:
            return frozenset()
        live = [m for g in inventory.gpus for m in g.mig_instances] if inventory is not None else []
        return owned_instances(journal, live)

    # -- shared with teardown -------------------------------------------------------------

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
        if self.pending_removals:
            owed = {uid for uid in self.pending_removals if uid in journal}
            kept = self.timeslices.release(journal, sorted(owed))  # GPUs first, then entries
            for uid in owed - kept.keys():
                del journal[uid]
            if owed - kept.keys():
                self.checkpoint.store(journal)
            self.pending_removals = set(kept)
        return journal

    def fail(self, ref: ClaimRef, claim: dict[str, Any] | None, err: DriverError) -> PrepareResult:
        if err.permanent and err.error_class not in self.permanent_errors:
            err = DriverError(
                ErrorClass.TRANSIENT,
                f"{err.error_class.value}: {err.message} "
                "(treated as transient: class not in --permanent-errors)",
            )
        if not err.permanent:
            self.stats.transient_failures += 1
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
