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
whole batch, which is then rolled back. Unprepare and start-up
recovery live in driver/state/teardown.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.errors import DriverError, ErrorClass, transient
from driver.observability import metrics
from driver.state import teardown
from driver.state.booking import refuse_double_booking, refuse_over_capacity
from driver.state.cdi import CdiSpecs, ClaimSpec
from driver.state.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
    SerializeLock,
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
from driver.state.failpoints import failpoint
from driver.state.instances import ClaimInstances, MigOps
from driver.state.planning import CdiContext, PlannedDevice, check_health, plan_claim, render_spec
from driver.state.teardown import RecoveryReport
from driver.state.verdicts import (
    DEFAULT_PERMANENT_ERRORS,
    DEFAULT_VERDICT_LIMIT,
    DEFAULT_VERDICT_TTL,
    VerdictMemory,
)

log = logging.getLogger(__name__)

PREPARE_STARTED = ClaimState.PREPARE_STARTED


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


@dataclass
class _Work:
    """A claim of the current batch that is being written."""

    ref: ClaimRef
    claim: dict[str, Any]
    planned: tuple[PlannedDevice, ...]
    spec: ClaimSpec | None = None
    error: DriverError | None = None

    def entry(self, state: ClaimState) -> ClaimEntry:
        devices = tuple(p.prepared for p in self.planned)
        spec = self.spec if state is ClaimState.PREPARE_COMPLETED else None
        return ClaimEntry(state, self.ref.namespace, self.ref.name, devices, spec)


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
        permanent_errors: Iterable[ErrorClass] = DEFAULT_PERMANENT_ERRORS,
        lock_timeout: float = 10.0,
        verdict_ttl: float = DEFAULT_VERDICT_TTL,
        verdict_limit: int = DEFAULT_VERDICT_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.devices = devices  # replaced by the plugin once discovery ran
        self.cdi = CdiSpecs(cdi_root, driver_name)
        self.checkpoint = Checkpoint(data_dir)
        self.real_devices = real_devices
        self.context = CdiContext(real_devices=real_devices, caps_root=caps_root)
        self.instances = ClaimInstances(mig)
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
                self._prepare_batch(todo, journal, results)
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

    def owned_mig(self) -> frozenset[tuple[str, int]]:
        """(GPU UUID, GPU-instance id) of every MIG device a completed claim owns. With
        a corrupt journal nothing is known to be owned: every MIG device counts as
        foreign, so none is ever destroyed or overlapped until the journal is repaired."""
        with self.lock.hold():
            try:
                journal = self.checkpoint.load()
            except CheckpointCorruptError:
                return frozenset()
        return frozenset(
            (d.mig.gpu_uuid, d.mig.gi_id)
            for entry in journal.values()
            for d in entry.devices
            if d.mig is not None and d.mig.owned and d.mig.gi_id is not None
        )

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
            for uid in owed:
                del journal[uid]
            if owed:
                self.checkpoint.store(journal)
            self.pending_removals.clear()
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

    # -- prepare under the lock ------------------------------------------------------------

    def _prepare_batch(
        self,
        todo: Sequence[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]],
        journal: dict[str, ClaimEntry],
        results: dict[str, PrepareResult],
    ) -> None:
        work: list[_Work] = []
        found: dict[str, ClaimEntry] = {}  # pre-existing entries of claims being redone
        planned: dict[str, ClaimEntry] = {}  # the new PrepareStarted entries
        for ref, claim, driver_results in todo:
            uid = ref.uid
            entry = journal.get(uid)
            if entry is not None and entry.state is ClaimState.PREPARE_COMPLETED:
                try:
                    if self._spec_in_place(uid, entry):
                        self.stats.idempotent_hits += 1
                        results[uid] = PrepareResult(devices=entry.devices)
                        continue
                except OSError as err:
                    error = transient(f"cannot rewrite the CDI spec of {uid}: {err}")
                    results[uid] = self.fail(ref, claim, error)
                    continue
            try:
                w = _Work(ref, claim, self._plan(ref, claim, driver_results))
                devices = tuple(p.prepared for p in w.planned)
                # Against every journal entry (a found entry of a claim being redone
                # holds its old devices until it is rolled back) and every claim
                # planned before this one in the same request.
                refuse_double_booking(uid, devices, journal, self.devices)
                refuse_double_booking(uid, devices, planned, self.devices)
                refuse_over_capacity(uid, devices, self.devices, journal, planned)
            except Exception as exc:
                results[uid] = self.fail(ref, claim, self._error(exc, uid))
                continue
            if entry is not None:
                found[uid] = entry
            planned[uid] = w.entry(PREPARE_STARTED)
            work.append(w)
        if not work:
            return
        journal.update(planned)
        if found:
            work = self._roll_back_found(work, found, journal, results)
            if not work:
                return

        failpoint("prepare-before-started")
        try:
            # No directory fsync: a crash of the process keeps the rename (page cache),
            # and a power loss, which could lose it, also takes every MIG device with
            # it; the specs written next are made safe by the PrepareCompleted store.
            self.checkpoint.store(
                journal, before_rename="prepare-started-before-rename", sync_dir=False
            )
        except DriverError as err:
            self._abort(work, journal, results, err)
            return
        failpoint("prepare-after-started")

        # Each spec's content is fsynced before its rename, so a spec on disk is whole;
        # the renames are not synced: the PrepareCompleted entries carry every spec,
        # and recover() rewrites one a power loss took before the kubelet can use it.
        for w in work:
            try:
                w.planned = tuple(self.instances.create(w.planned))
                w.spec = render_spec(w.planned, self.context)
                self.cdi.write_claim_spec(
                    w.ref.uid, w.spec, before_rename="prepare-cdi-before-rename", sync_dir=False
                )
            except Exception as exc:
                w.error = self._error(exc, w.ref.uid)
        failpoint("prepare-after-cdi")

        failed = [w for w in work if w.error is not None]
        if failed:  # specs and MIG devices go now, entries in the PrepareCompleted store
            self._undo(failed, journal)
            self._fail_work(failed, results)
            work = [w for w in work if w.error is None]
        for w in work:
            journal[w.ref.uid] = w.entry(ClaimState.PREPARE_COMPLETED)
        try:
            self.checkpoint.store(journal, before_rename="prepare-completed-before-rename")
        except DriverError as err:
            self._abort(work, journal, results, err)
            return
        failpoint("prepare-after-completed")
        for w in work:
            self.stats.prepared += 1
            results[w.ref.uid] = PrepareResult(devices=tuple(p.prepared for p in w.planned))

    def _plan(
        self, ref: ClaimRef, claim: dict[str, Any], driver_results: list[dict[str, Any]]
    ) -> tuple[PlannedDevice, ...]:
        return plan_claim(
            ref,
            claim,
            driver_results,
            driver_name=self.driver_name,
            devices=self.devices,
            cdi_ids=self.cdi.device_ids,
        )

    def _roll_back_found(
        self,
        work: list[_Work],
        found: dict[str, ClaimEntry],
        journal: dict[str, ClaimEntry],
        results: dict[str, PrepareResult],
    ) -> list[_Work]:
        """Half-done entries of claims being redone: their specs and MIG devices go
        before anything new is written. One that cannot be rolled back stays as it
        was found (the retry or recover() redoes it)."""
        self.stats.rollbacks += len(found)
        log.info("rolling back %d found entries before redoing them", len(found))
        _, errors = self.cdi.remove_claim_specs(sorted(found))
        failpoint("prepare-rollback-after-cdi-removed")
        for w in work:
            uid = w.ref.uid
            if uid not in found:
                continue
            try:
                if uid in errors:
                    raise transient(f"rolling back claim {uid}: {errors[uid]}")
                self.instances.destroy(found[uid].devices)
            except DriverError as err:
                journal[uid] = found[uid]
                w.error = err
        self._fail_work(work, results)
        return [w for w in work if w.error is None]

    def _spec_in_place(self, uid: str, entry: ClaimEntry) -> bool:
        """Is the completed claim's CDI spec on disk, rewritten from the journal if it
        was lost? False only for an entry without a stored spec (then it is redone)."""
        if self.cdi.claim_spec_exists(uid):
            return True
        if entry.cdi_spec is None:
            return False
        self.cdi.write_claim_spec(uid, entry.cdi_spec)
        log.warning("rewrote the lost CDI spec of prepared claim %s from the journal", uid)
        return True

    def _error(self, exc: BaseException, uid: str) -> DriverError:
        if isinstance(exc, DriverError):
            return exc
        log.error("prepare of claim %s failed", uid, exc_info=exc)
        return as_transient(exc)

    def _fail_work(self, work: Sequence[_Work], results: dict[str, PrepareResult]) -> None:
        for w in work:
            if w.error is not None and w.ref.uid not in results:
                results[w.ref.uid] = self.fail(w.ref, w.claim, w.error)

    def _undo(self, work: Sequence[_Work], journal: dict[str, ClaimEntry]) -> set[str]:
        """Remove the claims' specs and MIG devices; drop the entries of those fully
        undone. The others stay `PrepareStarted`: the retry or recover() finishes."""
        _, errors = self.cdi.remove_claim_specs([w.ref.uid for w in work])
        undone: set[str] = set()
        for w in work:
            uid = w.ref.uid
            try:
                if uid in errors:
                    raise transient(str(errors[uid]))
                self.instances.destroy(tuple(p.prepared for p in w.planned))
            except DriverError as err:
                journal[uid] = w.entry(PREPARE_STARTED)
                log.error("rolling back claim %s failed: %s", uid, err)
                continue
            journal.pop(uid, None)
            undone.add(uid)
        return undone

    def _abort(
        self,
        work: Sequence[_Work],
        journal: dict[str, ClaimEntry],
        results: dict[str, PrepareResult],
        err: DriverError,
    ) -> None:
        """A journal store failed: fail every claim of the batch and roll them all back
        as far as the disk and NVML let us; whatever is left is a `PrepareStarted`
        entry that the retry or `recover()` rolls back."""
        for w in work:
            w.error = err
        undone = self._undo(work, journal)
        self._fail_work(work, results)
        if undone:
            try:
                self.checkpoint.store(journal)
            except DriverError as again:
                log.error("rolling back %d claims failed: %s", len(undone), again)


def as_transient(exc: BaseException) -> DriverError:
    return transient(f"{type(exc).__name__}: {exc}")
