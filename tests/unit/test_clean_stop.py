"""The plugin's clean stop waits (bounded) for the prepares and unprepares in flight
before it folds the journal's log into a `schemaVersion` 1 snapshot, and nothing is
journaled after that: a release before the log must read the journal a clean stop
leaves (docs/upgrade.md). gRPC's `server.stop(grace)` does not wait for the handler
threads, so a MIG prepare still creating its device would store after the compaction.

The prepare here is held inside its MIG create (outside the node lock) by an event the
test controls, so the order of events is fixed, not timed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_manager import MigManager, MigTarget
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.recovery.startup_recovery import compact_journal
from tests.unit.test_mig_prepare import H100, Node, make_node

DEVICE = "gpu-0-mig-1g10gb-0"


class HeldCreate:
    """Every MIG create waits for `release` once it has begun (`entered`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = MigManager.create

        def held(manager: MigManager, target: MigTarget) -> MigInstance:
            self.entered.set()
            assert self.release.wait(timeout=60)
            return real(manager, target)

        monkeypatch.setattr(MigManager, "create", held)


def _prepare_in_flight(node: Node, create: HeldCreate) -> tuple[threading.Thread, dict[str, Any]]:
    answer: dict[str, Any] = {}
    ref = node.claims.add("late", DEVICE)
    thread = threading.Thread(target=lambda: answer.update(node.state.prepare([ref])))
    thread.start()
    assert create.entered.wait(timeout=60)
    return thread, answer


def test_the_stop_waits_for_a_prepare_in_flight_then_compacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(tmp_path, H100)
    create = HeldCreate(monkeypatch)
    prepare, answer = _prepare_in_flight(node, create)
    real_drain = node.state.in_flight.drain

    def drain_releasing(timeout: float) -> bool:
        create.release.set()  # the create finishes once the stop waits for it
        return real_drain(timeout)

    monkeypatch.setattr(node.state.in_flight, "drain", drain_releasing)
    compact_journal(node.state, drain_seconds=60)
    prepare.join(timeout=60)
    assert answer["late"].ok, answer["late"].error
    cp = Checkpoint(tmp_path / "plugin")
    assert cp.inspect().schema_version == 1
    assert cp.load()["late"].state is ClaimState.PREPARE_COMPLETED


def test_a_prepare_that_outlasts_the_drain_fails_and_journals_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(tmp_path, H100)
    create = HeldCreate(monkeypatch)
    prepare, answer = _prepare_in_flight(node, create)
    real_compact = Checkpoint.compact

    def compact_then_release(cp: Checkpoint) -> bool:
        done = real_compact(cp)
        create.release.set()  # the create finishes only after the compaction
        return done

    monkeypatch.setattr(Checkpoint, "compact", compact_then_release)
    compact_journal(node.state, drain_seconds=0)
    prepare.join(timeout=60)
    error = answer["late"].error
    assert error is not None and "stopping" in str(error)
    cp = Checkpoint(tmp_path / "plugin")
    assert cp.inspect().schema_version == 1  # nothing stored after the compaction
    assert cp.load()["late"].state is ClaimState.PREPARE_STARTED  # rolled back at start
    assert node.live() == []  # its MIG device destroyed again
