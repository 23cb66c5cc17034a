"""Prepare ResourceClaims on this node: the facade the plugin calls, and the walk of
one request through its stages (docs/architecture.md, docs/state.md, docs/mig.md).

1. Decode (driver/state/request.py), per claim, outside the node lock: a remembered
   permanent verdict for the UID is answered again at once (no API read, no NVML, no
   disk); the others are read from the API (several reads in flight) and checked:
   UID, allocated to this node with results for this driver, healthy devices (a
   failed device is tainted - the wait for the API server happens here, so an API
   outage never stalls other claims - then permanent device-failed).
2. Plan (driver/state/plan.py), under the node lock with the journal loaded and the
   unprepares owed finished (driver/state/teardown.py): a completed claim is answered
   as before (idempotent; a lost CDI spec is rewritten from the journal); the others
   are planned (configs -> invalid-config; device rules) and booked against the
   hardware every other entry holds. A claim held up by a request in flight outside
   the lock is deferred: it waits, holding no lock, and is planned again.
3. Apply (driver/state/apply.py): found half-done entries rolled back; then, after
   the intent of step 5, MIG devices created (outside the node lock, holding the
   claims' locks), time-slice intervals set, MPS daemons started.
4. and 5. Commit (driver/state/commit.py): ONE `PrepareStarted` store (the intent) for
   a batch that changes the node, before step 3 creates anything; the CDI specs
   written (not fsynced; rendered by driver/state/spec_render.py); ONE
   `PrepareCompleted` store, whose directory fsync is the only one.
6. Answer: one `PrepareResult` per claim.

A claim that fails in steps 3-5 is undone alone (spec removed, MIG devices destroyed,
entry dropped in the next store); only a failed journal store fails the whole batch,
which is then undone. Unprepare lives in driver/state/teardown.py, start-up recovery
in driver/state/recovery/startup_recovery.py; all take the `StepContext`
(driver/state/context.py) this facade extends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from driver.errors import DriverError, transient
from driver.nvml.discovered import Inventory
from driver.observability import metrics
from driver.state import apply, commit, plan, teardown
from driver.state.batch import Batch, Deferred, Work, as_transient
from driver.state.context import StepContext
from driver.state.journal.checkpoint import CheckpointCorruptError, ClaimEntry
from driver.state.mig_instances import Held, owned_instances
from driver.state.plan import Todo
from driver.state.recovery import startup_recovery
from driver.state.recovery.startup_recovery import RecoveryReport
from driver.state.request import (
    ClaimRef,
    PrepareResult,
    check_claim,
    check_health,
    read_claims,
    unique,
)

log = logging.getLogger(__name__)


class DeviceState(StepContext):
    """Prepare/unprepare for one node: the facade the plugin calls. Thread-safe; safe
    across plugin instances that share `data_dir` (serialised by
    `<data_dir>/serialize.lock`, and the claim locks of requests in flight outside
    it, driver/state/journal/locking.py)."""

    # -- public ------------------------------------------------------------------------

    def remembered_verdict(self, uid: str) -> DriverError | None:
        return self.verdicts.get(uid)

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare every claim; one result per UID, never raises for a claim's failure."""
        with self.in_flight.call():
            return self._prepare(claims)

    def _prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
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

        deadline = time.monotonic() + self.lock.timeout
        while todo:
            deferred = self._prepare_round(todo, results)
            todo = [t for t in todo if t[0].uid in deferred]
            blockers = {d.blocker for d in deferred.values()}
            if todo and not self.claim_locks.wait_free(blockers, deadline):
                for ref, claim, _ in todo:
                    results[ref.uid] = self.fail(ref, claim, deferred[ref.uid].error)
                break
        return results

    def _prepare_round(self, todo: Todo, results: dict[str, PrepareResult]) -> dict[str, Deferred]:
        """Plan and write the claims of `todo` that no request in flight holds up;
        returns those it does (they wait for it, holding no lock, and come again)."""
        deferred: dict[str, Deferred] = {}
        batch: Batch | None = None
        with self.claim_locks.round() as holds:
            try:
                with self.lock.hold():
                    journal = self._journal()
                    batch, deferred = plan.plan_batch(self, todo, journal, results, holds)
                    if batch is not None:
                        batch = apply.clear_the_way(self, batch, journal, results)
                    if batch is not None:
                        batch = commit.store_intent(self, batch, journal, results)
                    if batch is not None and not batch.leaves_lock:
                        apply.create_mig(self, batch)
                        self._write(batch, batch.work, journal, results)
                if batch is not None and batch.leaves_lock:
                    self._write_outside_lock(batch, results)
            except Exception as exc:  # lock timeout, unreadable/corrupt journal, a bug
                if isinstance(exc, CheckpointCorruptError):
                    self.stats.checkpoint_corrupt += 1
                if not isinstance(exc, DriverError):
                    log.exception("prepare failed")
                error = exc if isinstance(exc, DriverError) else as_transient(exc)
                for ref, claim, _ in todo:
                    if ref.uid not in results and ref.uid not in deferred:
                        results[ref.uid] = self.fail(ref, claim, error)
        return deferred

    def _journal(self) -> dict[str, ClaimEntry]:
        """The journal, under the node lock, with the unprepares owed finished."""
        journal = self.load_journal()
        if self.pending_removals or any(e.unpreparing is not None for e in journal.values()):
            teardown.finish_owed(self, journal)
        return journal

    def _write(
        self,
        batch: Batch,
        work: Sequence[Work],
        journal: dict[str, ClaimEntry],
        results: dict[str, PrepareResult],
    ) -> None:
        """Steps 3 to 6 under the node lock, once the MIG devices exist."""
        apply.share(self, work, journal)
        commit.write_specs(self, batch, work)
        commit.complete(self, work, journal, results)

    def _write_outside_lock(self, batch: Batch, results: dict[str, PrepareResult]) -> None:
        """A batch that creates MIG devices creates them outside the node lock, then
        takes it again and reads the journal again (other requests stored theirs
        meanwhile) for the rest. If the lock or the journal cannot be had, its MIG
        devices are destroyed again and every claim fails; its `PrepareStarted`
        entries are rolled back by the kubelet's retry or the next start."""
        apply.create_mig(self, batch)
        try:
            with self.lock.hold():
                journal = self._journal()
                work = apply.still_journaled(self, batch.work, journal, results)
                self._write(batch, work, journal, results)
        except Exception as exc:
            if not isinstance(exc, DriverError):
                log.exception("completing a prepare failed")
            error = exc if isinstance(exc, DriverError) else as_transient(exc)
            apply.abandon(self, batch.work, batch.work, (), error, results)

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
        """Remove each claim's local state. Never permanent; unknown claims succeed."""
        with self.in_flight.call():
            return teardown.unprepare(self, claims)

    def recover(self) -> RecoveryReport:
        """Start-up reconciliation of the journal, the CDI specs and the MIG devices."""
        return startup_recovery.recover(self)

    def owned_mig(self, inventory: Inventory | None = None) -> Held:
        """(GPU UUID, GPU-instance id) of every MIG device the journal owns: a
        completed claim's, and with `inventory` the one a `PrepareStarted` intent's
        attempt may have created (`instances.owned_instances`). With a corrupt journal
        nothing is known to be owned: every MIG device counts as foreign, so none is
        ever destroyed or overlapped until the journal is repaired."""
        with self.lock.hold():
            return self._owned_locked(inventory)

    def discover_with_owned(self, discover: Callable[[], Inventory]) -> tuple[Inventory, Held]:
        """`discover()` and `owned_mig()` of one moment, both under the node lock. A
        plugin instance still serving (a rolling update) creates and destroys MIG
        devices outside that lock, but journals each intent before the create and
        drops an entry only after the destroy, both under it: every MIG device of
        ours in the listing has its entry in the snapshot."""
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
