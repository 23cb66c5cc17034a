"""Prepare and unprepare ResourceClaims on this node (DESIGN.md §6, §8; docs/state.md).

`DeviceState` is transport-free: the gRPC servicer hands it `ClaimRef`s and turns the
results into protobuf; the Kubernetes API, device health and failure reporting come
in as the small protocols below.

`prepare` of a request (a batch of claims) does:

1. per claim, a remembered permanent verdict for the UID is answered again at once (no
   API read, no NVML, no disk access, not even the lock file);
2. per claim, read it; its UID must match, it must be allocated, to this node, with
   results for this driver (failures: transient);
3. under the serialize lock, with the journal loaded, per claim: a `PrepareCompleted`
   entry whose CDI spec exists is answered as before (idempotent); otherwise plan it:
   resolve configs (`ConfigError` -> permanent invalid-config); device health (a
   failed device is tainted, the taint accepted by the API server, then permanent
   device-failed); device rules (impossible partition count -> invalid-config); no
   device may be held by another journal entry or by a claim planned earlier in the
   same request unless both hold shares / admin access;
4. found entries of planned claims (half-done prepare, or a completed one whose CDI
   spec vanished) are rolled back: their CDI specs removed (one directory fsync);
5. ONE journal store with every planned claim's `PrepareStarted` entry -> every CDI
   spec (atomic, one fsync of the CDI root for the batch) -> ONE journal store with
   the `PrepareCompleted` entries.

So a batch costs two journal writes plus one spec per claim. A claim that fails in
steps 4-5 is rolled back alone (its spec removed, its entry dropped in the next
store); only a failed journal store or CDI root fsync fails the whole batch, which is
then rolled back. A failed prepare leaves nothing behind. Permanent verdicts are
remembered (bounded, with a TTL), an Event/condition is reported once per verdict,
and `--permanent-errors` can downgrade a class to transient.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from driver.config import GpuConfig, resolve_configs, validate_for_device
from driver.errors import DriverError, ErrorClass, device_failed, transient
from driver.observability import metrics
from driver.state.cdi import (
    CONTROL_DEVICE_NODES,
    CdiDevice,
    CdiSpecs,
    ClaimSpec,
    SharingEnv,
    cdi_device_name,
    claim_device_env,
    visible_device_id,
)
from driver.state.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
    PreparedDevice,
    SerializeLock,
)
from driver.state.failpoints import failpoint

log = logging.getLogger(__name__)

DEFAULT_PERMANENT_ERRORS: Final = frozenset({ErrorClass.INVALID_CONFIG, ErrorClass.DEVICE_FAILED})
DEFAULT_VERDICT_TTL: Final = 300.0
DEFAULT_VERDICT_LIMIT: Final = 4096
PREPARE_STARTED: Final = ClaimState.PREPARE_STARTED

__all__ = [
    "DEFAULT_PERMANENT_ERRORS",
    "ClaimReader",
    "ClaimRef",
    "DeviceHealth",
    "DeviceState",
    "FailureReporter",
    "PreparableDevice",
    "PrepareResult",
    "PreparedDevice",
    "RecoveryReport",
    "StateStats",
    "parse_permanent_errors",
]


# -- collaborators -----------------------------------------------------------------------


class ClaimReader(Protocol):
    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim as raw JSON. Raises a transient DriverError on API errors
        (including not found)."""
        ...


class DeviceHealth(Protocol):
    def failure(self, device_name: str) -> str | None:
        """Why the device is unusable (critical Xid, lost), or None if healthy.
        Must not block on NVML: answered from the health monitor's state."""
        ...

    def ensure_tainted(self, device_name: str) -> None:
        """Return once the API server has accepted the device's taint; raise otherwise."""
        ...


class FailureReporter(Protocol):
    def permanent_failure(self, claim: dict[str, Any], error: DriverError) -> None:
        """Make a permanent failure visible: an Event on the claim and, where enabled,
        a condition in its device status. Called once per verdict; best effort."""
        ...


class PreparableDevice(Protocol):
    """What prepare needs of a published device (`driver.devices.model.PublishedDevice`)."""

    @property
    def name(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def gpu_minor(self) -> int | None: ...
    @property
    def is_partition(self) -> bool: ...
    @property
    def max_partitions(self) -> int | None: ...
    @property
    def profile(self) -> str | None: ...
    @property
    def placement(self) -> object: ...


# -- values --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PrepareResult:
    """The outcome for one claim: its devices, or an error (never both)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: DriverError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


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


@dataclass(frozen=True)
class RecoveryReport:
    """What `DeviceState.recover()` found and did at startup."""

    swept_temp_files: tuple[Path, ...] = ()
    rolled_back: tuple[str, ...] = ()  # PrepareStarted claims rolled back
    orphan_specs: tuple[str, ...] = ()  # claim specs without a journal entry (kept)
    recreated_specs: tuple[str, ...] = ()  # completed claims whose lost spec was rewritten
    missing_specs: tuple[str, ...] = ()  # completed claims whose spec is gone for good
    checkpoint_problem: str | None = None


def parse_permanent_errors(value: str) -> frozenset[ErrorClass]:
    """`--permanent-errors invalid-config,device-failed` -> the set of classes; ''
    means none. Raises ValueError naming an unknown or transient class."""
    classes: set[ErrorClass] = set()
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            cls = ErrorClass(part)
        except ValueError:
            raise ValueError(
                f"unknown error class {part!r} (known: invalid-config, device-failed)"
            ) from None
        if cls is ErrorClass.TRANSIENT:
            raise ValueError("transient is not a permanent error class")
        classes.add(cls)
    return frozenset(classes)


@dataclass(frozen=True)
class _Plan:
    devices: tuple[PreparedDevice, ...]
    spec: ClaimSpec


@dataclass
class _Work:
    """A claim of the current batch that is being written."""

    ref: ClaimRef
    claim: dict[str, Any]
    plan: _Plan
    written: bool = False  # its CDI spec was renamed into place
    error: DriverError | None = None


@dataclass
class _Verdict:
    error: DriverError
    expires: float


# -- the state machine ---------------------------------------------------------------------


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
        permanent_errors: Iterable[ErrorClass] = DEFAULT_PERMANENT_ERRORS,
        lock_timeout: float = 10.0,
        verdict_ttl: float = DEFAULT_VERDICT_TTL,
        verdict_limit: int = DEFAULT_VERDICT_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.devices = devices
        self.cdi = CdiSpecs(cdi_root, driver_name)
        self.checkpoint = Checkpoint(data_dir)
        self.real_devices = real_devices
        self.permanent_errors = frozenset(permanent_errors)
        self.stats = StateStats()
        self._claims = claims
        self._health = health
        self._reporter = reporter
        self._lock = SerializeLock(data_dir, timeout=lock_timeout)
        self._verdict_ttl = verdict_ttl
        self._verdict_limit = verdict_limit
        self._clock = clock
        self._verdicts: OrderedDict[str, _Verdict] = OrderedDict()
        self._verdict_lock = threading.Lock()
        # Journal removals owed by unprepares that ran while the journal was unreadable.
        self._pending_removals: set[str] = set()
        self._last_swept: list[Path] = []
        self._checkpoint_problem: str | None = None

    # -- public ------------------------------------------------------------------------

    @property
    def checkpoint_problem(self) -> str | None:
        """Why the journal is currently unusable (corrupt), or None. The plugin exposes
        this (log, metric, health); prepare is refused while it is set."""
        return self._checkpoint_problem

    def remembered_verdict(self, uid: str) -> DriverError | None:
        with self._verdict_lock:
            verdict = self._verdicts.get(uid)
            if verdict is None:
                return None
            if self._clock() >= verdict.expires:
                del self._verdicts[uid]
                return None
            return verdict.error

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare every claim; one result per UID, never raises for a claim's failure."""
        results: dict[str, PrepareResult] = {}
        to_read: list[ClaimRef] = []
        for ref in _unique(claims):
            remembered = self.remembered_verdict(ref.uid)
            if remembered is not None:
                self.stats.verdict_hits += 1
                metrics.PERMANENT_VERDICT_REPLAYS.labels(
                    error_class=remembered.error_class.value
                ).inc()
                results[ref.uid] = PrepareResult(error=remembered)
            else:
                to_read.append(ref)
        if not to_read:
            return results

        todo: list[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]] = []
        for ref in to_read:
            claim: dict[str, Any] | None = None
            try:
                claim = self._read_claim(ref)
                todo.append((ref, claim, self._check_claim(ref, claim)))
            except DriverError as err:
                results[ref.uid] = self._fail(ref, claim, err)
            except Exception as err:  # a malformed claim must never crash the call
                log.exception("reading claim %s/%s failed", ref.namespace, ref.name)
                results[ref.uid] = self._fail(ref, claim, transient(f"internal error: {err}"))
        if not todo:
            return results

        try:
            with self._lock.hold():
                journal = self._load_journal()
                self._prepare_batch(todo, journal, results)
        except Exception as exc:  # lock timeout, unreadable/corrupt journal, a bug
            if isinstance(exc, CheckpointCorruptError):
                self.stats.checkpoint_corrupt += 1
            if not isinstance(exc, DriverError):
                log.exception("prepare failed")
            error = exc if isinstance(exc, DriverError) else _as_transient(exc)
            for ref, claim, _ in todo:
                if ref.uid not in results:
                    results[ref.uid] = self._fail(ref, claim, error)
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
        """Remove each claim's local state. Never permanent; unknown claims succeed."""
        with self._verdict_lock:
            for ref in claims:
                self._verdicts.pop(ref.uid, None)
        results: dict[str, DriverError | None] = {}
        try:
            with self._lock.hold():
                journal: dict[str, ClaimEntry] | None
                try:
                    journal = self._load_journal()
                except CheckpointCorruptError as err:
                    self.stats.checkpoint_corrupt += 1
                    log.error("%s; unprepare removes CDI specs only", err)
                    journal = None
                results.update(self._unprepare_batch(_unique(claims), journal))
        except Exception as exc:  # lock timeout, unreadable journal, a bug
            if not isinstance(exc, DriverError):
                log.exception("unprepare failed")
            error = exc if isinstance(exc, DriverError) else _as_transient(exc)
            for ref in claims:
                results.setdefault(ref.uid, error)
        return results

    def recover(self) -> RecoveryReport:
        """Startup: (re)write the common CDI spec, remove crash leftovers (temp files,
        PrepareStarted entries and their specs), and report orphans. Never raises for a
        corrupt journal (reported in the result and `checkpoint_problem`)."""
        with self._lock.hold():
            self.cdi.write_common_spec(self.node_name)
            try:
                journal = self._load_journal()
            except CheckpointCorruptError as err:
                return RecoveryReport(checkpoint_problem=str(err))
            swept = tuple(self._last_swept)
            started = [u for u, e in sorted(journal.items()) if e.state is PREPARE_STARTED]
            rolled_back: list[str] = []
            if started:  # specs first (one fsync of the CDI root), then one journal store
                gone, errors = self._remove_specs(started)
                failpoint("prepare-rollback-after-cdi-removed")
                for uid, problem in errors.items():  # the entry keeps holding its devices
                    log.error("rolling back claim %s failed: %s", uid, problem)
                rolled_back = [uid for uid in started if uid in gone]
                for uid in rolled_back:
                    del journal[uid]
            if rolled_back:
                self.checkpoint.store(journal)
                self.stats.rollbacks += len(rolled_back)
            specs = self.cdi.list_claim_specs()
            orphans = tuple(uid for uid in specs if uid not in journal)
            lost = [uid for uid in sorted(journal) if uid not in specs]
            recreated, missing = self._recreate_specs(lost, journal)
        for uid in orphans:
            log.warning("CDI spec for claim %s has no journal entry; kept until unprepare", uid)
        for uid in missing:
            log.warning(
                "CDI spec of prepared claim %s is gone and its journal entry predates stored "
                "specs; the kubelet's next prepare of it redoes it",
                uid,
            )
        return RecoveryReport(swept, tuple(rolled_back), orphans, recreated, missing, None)

    def _recreate_specs(
        self, uids: Sequence[str], journal: Mapping[str, ClaimEntry]
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
            self.cdi.write_claim_spec(uid, spec, sync_dir=False)
            recreated.append(uid)
        if recreated:
            self.cdi.sync_root()
            log.info("recreated the CDI specs of %d prepared claim(s)", len(recreated))
        return tuple(recreated), tuple(missing)

    # -- claim checks ----------------------------------------------------------------------

    def _read_claim(self, ref: ClaimRef) -> dict[str, Any]:
        self.stats.claim_reads += 1
        claim = self._claims.get(ref.namespace, ref.name)
        if not isinstance(claim, dict):
            raise transient(f"claim {ref.namespace}/{ref.name}: API returned no object")
        return claim

    def _check_claim(self, ref: ClaimRef, claim: dict[str, Any]) -> list[dict[str, Any]]:
        """Validate the claim against the request; return this driver's results."""
        where = f"claim {ref.namespace}/{ref.name}"
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise transient(
                f"{where}: UID {uid} does not match the requested UID {ref.uid} "
                "(the claim was deleted and recreated)"
            )
        allocation = (claim.get("status") or {}).get("allocation")
        if not isinstance(allocation, dict):
            raise transient(f"{where}: claim not yet allocated")
        if not _allocated_to_node(allocation.get("nodeSelector"), self.node_name):
            raise transient(f"{where}: allocated to a different node, not {self.node_name}")
        results = (allocation.get("devices") or {}).get("results") or []
        mine = [r for r in results if isinstance(r, dict) and r.get("driver") == self.driver_name]
        if not mine:
            raise transient(f"{where}: no allocation results for driver {self.driver_name}")
        return mine

    # -- prepare under the lock ------------------------------------------------------------

    def _load_journal(self) -> dict[str, ClaimEntry]:
        self._last_swept = self.cdi.sweep_temp_files() + self.checkpoint.sweep_temp_files()
        for path in self._last_swept:
            log.warning("removed temp file left by a crash: %s", path)
        try:
            journal = self.checkpoint.load()
        except CheckpointCorruptError as err:
            if self._checkpoint_problem is None:
                log.error("%s", err)
            self._checkpoint_problem = str(err)
            raise
        self._checkpoint_problem = None
        if self._pending_removals:
            owed = {uid for uid in self._pending_removals if uid in journal}
            for uid in owed:
                del journal[uid]
            if owed:
                self.checkpoint.store(journal)
            self._pending_removals.clear()
        return journal

    def _prepare_batch(
        self,
        todo: Sequence[tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]],
        journal: dict[str, ClaimEntry],
        results: dict[str, PrepareResult],
    ) -> None:
        """Prepare the checked claims of one request under the lock, at a constant
        number of journal writes: plan all -> ONE store with every new `PrepareStarted`
        entry -> all CDI specs (one fsync of the CDI root) -> ONE store with the
        `PrepareCompleted` entries. A claim that fails is rolled back (spec removed,
        entry dropped in the next store) without touching the others; only a failed
        journal store or CDI root fsync fails (and rolls back) the whole batch."""
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
                    results[uid] = self._fail(
                        ref, claim, transient(f"cannot rewrite the CDI spec of {uid}: {err}")
                    )
                    continue
            try:
                plan = self._plan(ref, claim, driver_results)
                # Against every journal entry (a found entry of a claim being redone
                # holds its old devices until it is rolled back) and every claim
                # planned before this one in the same request.
                self._refuse_double_booking(uid, plan.devices, journal)
                self._refuse_double_booking(uid, plan.devices, planned)
            except Exception as exc:
                results[uid] = self._fail(ref, claim, self._error(exc, uid))
                continue
            if entry is not None:
                found[uid] = entry
            planned[uid] = ClaimEntry(PREPARE_STARTED, ref.namespace, ref.name, plan.devices)
            work.append(_Work(ref, claim, plan))
        if not work:
            return
        journal.update(planned)

        if found:  # half-done (or spec-less completed) entries: remove their specs first
            self.stats.rollbacks += len(found)
            log.info("rolling back %d found entries before redoing them", len(found))
            gone, errors = self._remove_specs(sorted(found))
            failpoint("prepare-rollback-after-cdi-removed")
            for w in work:
                uid = w.ref.uid
                if uid in errors:  # left as it was found; the retry or recover() redoes it
                    journal[uid] = found[uid]
                    w.error = transient(f"rolling back claim {uid}: {errors[uid]}")
            self._fail_work(work, results)
            work = [w for w in work if w.error is None]
            if not work:
                return

        failpoint("prepare-before-started")
        try:
            self.checkpoint.store(journal, before_rename="prepare-started-before-rename")
        except DriverError as err:
            self._abort(work, journal, results, err)
            return
        failpoint("prepare-after-started")

        for w in work:
            try:
                self.cdi.write_claim_spec(
                    w.ref.uid,
                    w.plan.spec,
                    before_rename="prepare-cdi-before-rename",
                    sync_dir=False,
                )
                w.written = True
            except Exception as exc:
                w.error = self._error(exc, w.ref.uid)
        if any(w.written for w in work):
            try:
                self.cdi.sync_root()  # one directory fsync for every spec of the batch
            except OSError as err:
                for w in work:
                    if w.written:
                        w.error = transient(f"cannot sync CDI root {self.cdi.root}: {err}")
        failpoint("prepare-after-cdi")

        failed = [w for w in work if w.error is not None]
        if failed:  # their specs go now, their entries in the PrepareCompleted store
            gone, errors = self._remove_specs([w.ref.uid for w in failed])
            for w in failed:
                if w.ref.uid in gone:
                    del journal[w.ref.uid]
                else:  # stays PrepareStarted: rolled back by a retry or recover()
                    log.error("rolling back claim %s failed: %s", w.ref.uid, errors[w.ref.uid])
            self._fail_work(failed, results)
            work = [w for w in work if w.error is None]
        for w in work:
            journal[w.ref.uid] = ClaimEntry(
                ClaimState.PREPARE_COMPLETED,
                w.ref.namespace,
                w.ref.name,
                w.plan.devices,
                w.plan.spec,
            )
        try:
            self.checkpoint.store(journal, before_rename="prepare-completed-before-rename")
        except DriverError as err:
            self._abort(work, journal, results, err)
            return
        failpoint("prepare-after-completed")
        for w in work:
            self.stats.prepared += 1
            results[w.ref.uid] = PrepareResult(devices=w.plan.devices)

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
        return _as_transient(exc)

    def _fail_work(self, work: Sequence[_Work], results: dict[str, PrepareResult]) -> None:
        for w in work:
            if w.error is not None and w.ref.uid not in results:
                results[w.ref.uid] = self._fail(w.ref, w.claim, w.error)

    def _abort(
        self,
        work: Sequence[_Work],
        journal: dict[str, ClaimEntry],
        results: dict[str, PrepareResult],
        err: DriverError,
    ) -> None:
        """A journal store failed: fail every claim of the batch and roll them all back
        (specs removed, entries dropped) as far as the disk lets us; whatever is left
        is a `PrepareStarted` entry that the retry or `recover()` rolls back."""
        gone, errors = self._remove_specs([w.ref.uid for w in work])
        for w in work:
            w.error = err
            if w.ref.uid in gone:
                journal.pop(w.ref.uid, None)
            else:  # never left as PrepareCompleted after answering with an error
                journal[w.ref.uid] = ClaimEntry(
                    PREPARE_STARTED, w.ref.namespace, w.ref.name, w.plan.devices
                )
                log.error("rolling back claim %s failed: %s", w.ref.uid, errors[w.ref.uid])
        self._fail_work(work, results)
        if gone:
            try:
                self.checkpoint.store(journal)
            except DriverError as again:
                log.error("rolling back %d claims failed: %s", len(gone), again)

    def _remove_specs(self, uids: Sequence[str]) -> tuple[set[str], dict[str, OSError]]:
        """Remove the claims' CDI specs with one fsync of the CDI root. Returns the
        UIDs whose spec is durably gone and the errors of the others."""
        gone: set[str] = set()
        errors: dict[str, OSError] = {}
        removed = False
        for uid in uids:
            try:
                removed = self.cdi.remove_claim_spec(uid, sync_dir=False) or removed
                gone.add(uid)
            except OSError as err:
                errors[uid] = err
        if removed:
            try:
                self.cdi.sync_root()
            except OSError as err:
                errors.update(dict.fromkeys(gone, err))
                gone.clear()
        return gone, errors

    def _plan(
        self, ref: ClaimRef, claim: dict[str, Any], driver_results: list[dict[str, Any]]
    ) -> _Plan:
        allocation = claim["status"]["allocation"]
        configs = resolve_configs(allocation, self.driver_name)  # ConfigError: invalid-config

        failed: list[str] = []
        for result in driver_results:
            name = str(result.get("device"))
            reason = self._health.failure(name)
            if reason is not None:
                failed.append(f"{name}: {reason}")
                try:
                    self._health.ensure_tainted(name)
                except Exception as err:  # not permanent until the API accepted the taint
                    raise transient(
                        f"device {name} failed ({reason}) but tainting it failed: {err}"
                    ) from err
        if failed:
            raise device_failed(
                f"allocated device(s) unusable for claim {ref.namespace}/{ref.name}: "
                + "; ".join(failed)
                + " (tainted; the scheduler will not pick them again)"
            )

        prepared: list[PreparedDevice] = []
        cdi_devices: list[CdiDevice] = []
        visible: list[str] = []
        for result in driver_results:
            name = str(result.get("device"))
            device = self.devices.get(name)
            if device is None:
                raise transient(
                    f"requested device is not allocatable: {name} (not published by this node)"
                )
            request = str(result.get("request"))
            config = configs[request]
            validate_for_device(
                config,
                device_name=name,
                is_partition=device.is_partition,
                max_partitions=device.max_partitions,
            )
            share_id = result.get("shareID") or None
            admin = bool(result.get("adminAccess", False))
            prepared.append(
                PreparedDevice(
                    pool_name=str(result.get("pool")),
                    device_name=name,
                    request_names=(request.split("/", 1)[0],),
                    cdi_device_ids=tuple(self.cdi.device_ids(ref.uid, name, share_id)),
                    share_id=share_id,
                    admin_access=admin,
                )
            )
            env = claim_device_env(
                claim_uid=ref.uid,
                device_name=name,
                admin_access=admin,
                sharing=_sharing_env(config),
                consumed_capacity=result.get("consumedCapacity"),
            )
            nodes: tuple[str, ...] = ()
            if self.real_devices:
                vid = visible_device_id(
                    gpu_uuid=device.gpu_uuid,
                    is_partition=device.is_partition,
                    profile=device.profile,
                    placement_start=_placement_start(device.placement),
                )
                if vid not in visible:
                    visible.append(vid)
                if device.gpu_minor is not None:
                    nodes = (f"/dev/nvidia{device.gpu_minor}",)
            cdi_devices.append(
                CdiDevice(
                    name=cdi_device_name(ref.uid, name, share_id),
                    env=tuple(env),
                    device_nodes=nodes,
                )
            )
        spec_nodes: tuple[str, ...] = ()
        if self.real_devices:
            # One value per claim on every device of the claim: identical values, so a
            # container that gets several of the claim's devices sees all of them.
            extra = f"NVIDIA_VISIBLE_DEVICES={','.join(visible)}"
            cdi_devices = [CdiDevice(d.name, (*d.env, extra), d.device_nodes) for d in cdi_devices]
            spec_nodes = CONTROL_DEVICE_NODES
        return _Plan(tuple(prepared), ClaimSpec(tuple(cdi_devices), spec_nodes))

    def _refuse_double_booking(
        self, uid: str, planned: tuple[PreparedDevice, ...], journal: Mapping[str, ClaimEntry]
    ) -> None:
        for other_uid, entry in journal.items():
            if other_uid == uid:
                continue
            for held in entry.devices:
                for new in planned:
                    if self._overlap(held, new):
                        raise transient(
                            f"device {new.device_name} overlaps device {held.device_name} "
                            f"already prepared for claim {entry.namespace}/{entry.name} "
                            f"({other_uid}, {entry.state}); refusing to hand it to a second claim"
                        )

    def _overlap(self, held: PreparedDevice, new: PreparedDevice) -> bool:
        if held.admin_access or new.admin_access or held.pool_name != new.pool_name:
            return False
        if held.share_id and new.share_id:  # shares of multi-allocatable devices
            return False
        if held.device_name == new.device_name:
            return True
        a, b = self.devices.get(held.device_name), self.devices.get(new.device_name)
        # A whole GPU and one of its partitions.
        return (
            a is not None
            and b is not None
            and a.gpu_uuid == b.gpu_uuid
            and a.is_partition != b.is_partition
        )

    # -- unprepare under the lock ----------------------------------------------------------

    def _unprepare_batch(
        self, claims: Sequence[ClaimRef], journal: dict[str, ClaimEntry] | None
    ) -> dict[str, DriverError | None]:
        """Remove every claim's CDI spec (one fsync of the CDI root), then drop their
        entries in ONE journal store. A claim whose spec could not be removed keeps
        its entry (and so its devices) and gets a transient error."""
        results: dict[str, DriverError | None] = {}
        targets: list[str] = []
        for ref in claims:
            uid = ref.uid
            if (journal is None or uid not in journal) and not self.cdi.claim_spec_exists(uid):
                if journal is None:
                    self._pending_removals.add(uid)
                results[uid] = None  # unknown or already unprepared: nothing to write
            else:
                targets.append(uid)
        if not targets:
            return results

        failpoint("unprepare-before-cdi-removed")
        gone, errors = self._remove_specs(targets)
        failpoint("unprepare-after-cdi-removed")
        for uid, err in errors.items():
            results[uid] = transient(f"unprepare of claim {uid}: {err}")
        done = [uid for uid in targets if uid in gone]
        if journal is None:
            self._pending_removals.update(done)  # removed once the journal is readable
        else:
            dropped = [uid for uid in done if journal.pop(uid, None) is not None]
            if dropped:
                try:
                    self.checkpoint.store(journal, before_rename="unprepare-entry-before-rename")
                except DriverError as err:
                    for uid in dropped:
                        results[uid] = err
                    done = [uid for uid in done if uid not in dropped]
                else:
                    failpoint("unprepare-after-entry-removed")
        for uid in done:
            results[uid] = None
        self.stats.unprepared += len(done)
        return results

    # -- verdicts ------------------------------------------------------------------------

    def _fail(self, ref: ClaimRef, claim: dict[str, Any] | None, err: DriverError) -> PrepareResult:
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
        self._remember(ref.uid, err)
        log.warning("claim %s/%s (%s): %s", ref.namespace, ref.name, ref.uid, err)
        if claim is not None:
            try:
                self._reporter.permanent_failure(claim, err)
            except Exception:  # visibility is best effort; the verdict stands
                log.exception("reporting the permanent failure of claim %s failed", ref.uid)
        return PrepareResult(error=err)

    def _remember(self, uid: str, err: DriverError) -> None:
        with self._verdict_lock:
            self._verdicts[uid] = _Verdict(err, self._clock() + self._verdict_ttl)
            self._verdicts.move_to_end(uid)
            while len(self._verdicts) > self._verdict_limit:
                self._verdicts.popitem(last=False)


# -- helpers -----------------------------------------------------------------------------


def _unique(claims: Iterable[ClaimRef]) -> list[ClaimRef]:
    """The claims without repeated UIDs (first occurrence wins)."""
    seen: set[str] = set()
    out: list[ClaimRef] = []
    for ref in claims:
        if ref.uid not in seen:
            seen.add(ref.uid)
            out.append(ref)
    return out


def _as_transient(exc: BaseException) -> DriverError:
    return transient(f"{type(exc).__name__}: {exc}")


def _sharing_env(config: GpuConfig) -> SharingEnv:
    return SharingEnv(
        strategy=config.strategy.value,
        interval=config.interval.value if config.interval is not None else None,
        partition_count=config.partition_count,
    )


def _placement_start(placement: object) -> int | None:
    if isinstance(placement, tuple | list) and placement and isinstance(placement[0], int):
        return placement[0]
    start = getattr(placement, "start", None)
    return start if isinstance(start, int) else None


def _allocated_to_node(selector: object, node_name: str) -> bool:
    """Does an allocation's nodeSelector admit `node_name`? Only `metadata.name` field
    selectors can be evaluated here; label expressions are assumed to match."""
    if not isinstance(selector, dict):
        return True
    terms = selector.get("nodeSelectorTerms") or []
    if not terms:
        return True
    return any(_term_admits(term, node_name) for term in terms if isinstance(term, dict))


def _term_admits(term: dict[str, Any], node_name: str) -> bool:
    for req in term.get("matchFields") or []:
        if not isinstance(req, dict) or req.get("key") != "metadata.name":
            continue
        values = req.get("values") or []
        if req.get("operator") == "In" and node_name not in values:
            return False
        if req.get("operator") == "NotIn" and node_name in values:
            return False
    return True
