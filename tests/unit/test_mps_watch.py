"""The MPS daemons of prepared claims watched while the plugin runs (docs/mps.md,
"Lifecycle"): a daemon that dies is started again with its limits (node processes)
or its Deployment created again (Kubernetes), the journal records the new daemon, the
claim gets a Warning Event and gpu_dra_mps_daemon_lost_total counts it; a pod that is
not ready is reported, not replaced; a check that finds every daemon running writes
nothing; a claim in flight, an intent or a claim being unprepared is left alone."""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mps import DaemonId, find_binary, is_running
from driver.observability import metrics
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps_watch import REASON_LOST, REASON_NOT_READY, MpsWatch
from driver.state.request import ClaimRef
from tests.unit import test_mps_kube as kube
from tests.unit.test_mps_prepare import Node, mps_node, ok


class Events:
    """The claim Events the watch posts; `posted` is set at the first."""

    def __init__(self) -> None:
        self.events: list[tuple[ClaimRef, str, str]] = []
        self.posted = threading.Event()

    def post(self, claim: ClaimRef, reason: str, message: str) -> None:
        self.events.append((claim, reason, message))
        self.posted.set()


# Three whole GPUs (MIG off), one claim's daemon on each.
FLEET = parse_fleet({"gpus": [{"model": "H100-80GB", "count": 3, "migMode": "disabled"}]})


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path, FLEET)


def lost(outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value("gpu_dra_mps_daemon_lost_total", {"outcome": outcome})
    assert value is not None, f"no series for outcome {outcome}"
    return value


def kill(record: MpsRecord) -> None:
    os.kill(record.pid, signal.SIGKILL)
    while is_running(DaemonId(record.pid, record.start_time)):
        pass  # the daemon is no child of this process: init reaps it


def journal_files(root: Path) -> list[tuple[int, int]]:
    checkpoint = Checkpoint(root / "plugin")
    files = [checkpoint.path, checkpoint.log_path]
    return [(p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]


def test_a_killed_daemon_is_started_again_with_its_limits_and_reported(node: Node) -> None:
    state = node.state()
    ref = node.claims.add("a")
    ok(state, ref)
    killed = node.record("a")
    kill(killed)
    events = Events()
    before = lost("restarted")

    (seen,) = MpsWatch(state, events).check()

    again = node.record("a")  # the journal names the new daemon
    assert again.pid not in (0, killed.pid)
    assert again == MpsRecord(
        killed.gpu_uuid, killed.directory, 25, 2 << 30, again.pid, again.start_time
    )
    assert node.daemons() == [again.pid]
    dirs = node.dirs(again)  # the new daemon holds the claim's limits
    assert node.control.command(dirs, "get_default_active_thread_percentage") == "25.0"
    assert node.control.command(dirs, "get_default_device_pinned_mem_limit 0") == "2048M"
    ((claim, reason, message),) = events.events
    assert (claim, reason) == (ref, REASON_LOST)
    assert "device gpu-0" in message and killed.gpu_uuid in message, message
    assert f"pid {killed.pid}" in message and f"started again (pid {again.pid})" in message
    assert lost("restarted") == before + 1
    assert (seen.claim, seen.device, seen.running, seen.problem) == (ref, "gpu-0", True, None)
    assert seen.daemon == f"pid {again.pid}"


def test_a_check_with_every_daemon_running_changes_nothing(node: Node) -> None:
    state = node.state()
    ok(state, node.claims.add("a"), node.claims.add("b", "gpu-1", mps={}))
    files = journal_files(node.root)
    pids = sorted(node.daemons())
    events = Events()
    counts = (lost("restarted"), lost("failed"))

    watch = MpsWatch(state, events)
    seen = watch.check()

    assert events.events == []
    assert journal_files(node.root) == files
    assert sorted(node.daemons()) == pids
    assert (lost("restarted"), lost("failed")) == counts
    assert [(s.claim.uid, s.running) for s in seen] == [("a", True), ("b", True)]
    doc = watch.last().to_json()
    assert doc["checkedAt"] is not None
    assert [d["running"] for d in doc["daemons"]] == [True, True]
    assert watch.last().problems() == []


def test_a_daemon_that_cannot_be_started_is_reported_once_and_tried_again_less_often(
    node: Node,
) -> None:
    state = node.state()
    ref = node.claims.add("a")
    ok(state, ref)
    killed = node.record("a")
    binary = find_binary(node.control.driver_root)
    assert binary is not None
    kill(killed)
    binary.chmod(0o644)  # nvidia-cuda-mps-control cannot run
    events = Events()
    now = [1000.0]
    watch = MpsWatch(state, events, interval=30, clock=lambda: now[0])
    failed = lost("failed")

    (seen,) = watch.check()
    ((claim, reason, message),) = events.events
    assert (claim, reason) == (ref, REASON_LOST)
    assert "could not be started again" in message and "no executable" in message, message
    assert not seen.running and seen.problem is not None and "no executable" in seen.problem
    assert node.record("a") == killed  # the journal keeps the lost daemon
    assert lost("failed") == failed + 1
    (problem,) = watch.last().problems()
    assert "claim default/claim-a" in problem and "device gpu-0" in problem, problem

    now[0] += 29  # not tried again before the interval: the node lock stays free
    (seen,) = watch.check()
    assert not seen.running and lost("failed") == failed + 1
    now[0] += 1  # tried again, not reported again
    watch.check()
    assert len(events.events) == 1 and lost("failed") == failed + 2
    now[0] += 59  # then after twice the interval
    watch.check()
    assert lost("failed") == failed + 2

    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    now[0] += 1
    (seen,) = watch.check()
    assert seen.running and node.daemons() == [node.record("a").pid]
    assert [r for _, r, _ in events.events] == [REASON_LOST, REASON_LOST]
    assert "started again" in events.events[-1][2]


def test_claims_in_flight_being_unprepared_or_not_completed_are_not_checked(
    node: Node,
) -> None:
    state = node.state()
    for uid, device in (("busy", "gpu-0"), ("intent", "gpu-1"), ("unpreparing", "gpu-2")):
        ok(state, node.claims.add(uid, device))
    records = {uid: node.record(uid) for uid in ("busy", "intent", "unpreparing")}
    for record in records.values():
        kill(record)
    journal = state.checkpoint.load()
    journal["intent"] = replace(journal["intent"], state=ClaimState.PREPARE_STARTED)
    state.checkpoint.store(journal)
    state.cdi.remove_claim_specs(["unpreparing"])  # an unprepare removes the spec first
    files = journal_files(node.root)
    events = Events()
    with state.claim_locks.round() as holds:  # another request has "busy" in flight
        assert holds.take("busy")
        assert MpsWatch(state, events).check() == ()
    assert events.events == [] and node.daemons() == []
    assert journal_files(node.root) == files


def test_the_watch_thread_checks_until_stopped(node: Node) -> None:
    state = node.state()
    ok(state, node.claims.add("a"))
    kill(node.record("a"))
    events = Events()
    watch = MpsWatch(state, events, interval=3600)
    watch.start()
    try:
        assert events.posted.wait(60), "the first check runs at start"
    finally:
        watch.stop()
    assert [r for _, r, _ in events.events] == [REASON_LOST]
    assert node.daemons() == [node.record("a").pid]


# -- --mps-daemons=kubernetes ----------------------------------------------------------


@pytest.fixture
def cluster_node(tmp_path: Path) -> kube.Node:
    return kube.Node(tmp_path)


def test_a_deleted_deployment_is_created_again_and_reported(cluster_node: kube.Node) -> None:
    node = cluster_node
    state = node.state()
    ref = node.claims.add("a")
    assert state.prepare([ref])["a"].error is None
    before = node.record("a")
    del node.cluster.deployments[before.deployment]  # deleted behind the driver's back
    node.cluster.pods.pop(before.deployment)
    events = Events()
    restarted = lost("restarted")

    (seen,) = MpsWatch(state, events).check()

    again = node.record("a")
    assert again.deployment == before.deployment
    assert again.deployment_uid not in ("", before.deployment_uid)
    assert node.cluster.deployments[again.deployment]["metadata"]["uid"] == again.deployment_uid
    ((claim, reason, message),) = events.events
    assert (claim, reason) == (ref, REASON_LOST)
    assert f"Deployment {before.deployment}" in message and "device gpu-0" in message, message
    assert lost("restarted") == restarted + 1
    assert seen.running and seen.daemon == f"Deployment {again.deployment}"


def test_a_deployment_whose_pod_is_not_ready_is_reported_not_replaced(
    cluster_node: kube.Node,
) -> None:
    node = cluster_node
    state = node.state()
    ref = node.claims.add("a")
    assert state.prepare([ref])["a"].error is None
    record = node.record("a")
    node.cluster.ready_after = None  # its pod restarts: the Deployment has no ready replica
    node.cluster.deployments[record.deployment]["status"] = {
        "observedGeneration": 1,
        "readyReplicas": 0,
    }
    posts = node.cluster.log.count(f"POST {kube.DEPLOYMENTS}")
    files = journal_files(node.root)
    events = Events()
    watch = MpsWatch(state, events)

    (seen,) = watch.check()
    ((claim, reason, message),) = events.events
    assert (claim, reason) == (ref, REASON_NOT_READY)
    assert "ErrImagePull: no such image" in message and "device gpu-0" in message, message
    assert not seen.running and seen.problem is not None
    assert node.cluster.log.count(f"POST {kube.DEPLOYMENTS}") == posts
    assert journal_files(node.root) == files and node.record("a") == record

    watch.check()  # still not ready: reported once
    assert len(events.events) == 1
    node.cluster.deployments[record.deployment]["status"]["readyReplicas"] = 1
    (seen,) = watch.check()
    assert seen.running and len(events.events) == 1


def test_a_daemon_found_gone_at_the_plugins_start_gets_an_event_on_its_claim(
    node: Node,
) -> None:
    """Killed while no plugin ran: the start restarts it (`recover`) and the watch
    reports it like one found gone while running, once."""
    ok(node.state(), node.claims.add("a"))
    killed = node.record("a")
    kill(killed)
    state = node.state()  # the plugin starts again
    assert node.report.mps_lost == ("a",)
    again = node.record("a")
    events = Events()

    watch = MpsWatch(state, events)
    watch.report_start(node.report.mps_losses)
    watch.check()  # the daemon runs: nothing more to say

    ((claim, reason, message),) = events.events
    assert (claim.uid, claim.name, reason) == ("a", "claim-a", REASON_LOST)
    assert f"pid {killed.pid}" in message and f"started again (pid {again.pid})" in message
