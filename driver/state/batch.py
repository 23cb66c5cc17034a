"""A prepare request's batch as the stages pass it along (driver/state/prepare.py):
each claim being written (`Work`), the batch (`Batch`), a claim deferred behind a
request in flight (`Deferred`), and how a claim's failure becomes its answer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from driver.cdi.claim_specs import ClaimSpec
from driver.errors import DriverError, transient
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.request import ClaimRef, PrepareResult
from driver.state.spec_render import CdiContext, PlannedDevice

log = logging.getLogger(__name__)


@dataclass
class Work:
    """A claim of the current batch that is being written."""

    ref: ClaimRef
    claim: dict[str, Any]
    planned: tuple[PlannedDevice, ...]
    spec: ClaimSpec | None = None
    error: DriverError | None = None
    intent: ClaimEntry | None = None  # its PrepareStarted entry, as journaled

    @property
    def changes_the_node(self) -> bool:
        """Does the claim's prepare change state outside the data directory (a MIG
        device to create, a GPU's time-slice interval to set, an MPS daemon)? Then its
        intent is journaled first and the apply stage has work; a plain claim goes
        straight to `PrepareCompleted`, entering no feature's code."""
        return any(p.prepared.changes_the_node for p in self.planned)

    def entry(self, state: ClaimState) -> ClaimEntry:
        devices = tuple(p.prepared for p in self.planned)
        spec = self.spec if state is ClaimState.PREPARE_COMPLETED else None
        return ClaimEntry(state, self.ref.namespace, self.ref.name, devices, spec)


@dataclass(frozen=True)
class Deferred:
    """A claim planned again once `blocker`'s request in flight is done; `error` is
    its answer if that takes longer than the lock timeout."""

    blocker: str
    error: DriverError


@dataclass
class Batch:
    """The planned claims of a request, to be written."""

    work: list[Work]
    context: CdiContext  # how their specs are rendered
    # It creates MIG devices: the NVML calls run outside the node lock, its claims'
    # locks held (`ClaimHolds`), and the journal is read again for the rest.
    leaves_lock: bool
    found: dict[str, ClaimEntry]  # half-done entries of its claims, rolled back first


def claim_failure(exc: BaseException, uid: str) -> DriverError:
    if isinstance(exc, DriverError):
        return exc
    log.error("prepare of claim %s failed", uid, exc_info=exc)
    return as_transient(exc)


def fail_work(state: StepContext, work: Sequence[Work], results: dict[str, PrepareResult]) -> None:
    for w in work:
        if w.error is not None and w.ref.uid not in results:
            results[w.ref.uid] = state.fail(w.ref, w.claim, w.error)


def devices_of(w: Work) -> tuple[PreparedDevice, ...]:
    return tuple(p.prepared for p in w.planned)


def as_transient(exc: BaseException) -> DriverError:
    return transient(f"{type(exc).__name__}: {exc}")
