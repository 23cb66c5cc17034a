"""MPS daemons an operator can trust (issue 44, item 8; docs/mps.md, "Lifecycle";
docs/upgrade.md):

- unprepare stops the daemon the journal names whatever --mps-daemons says now (MPS
  turned off, or moved between node and kubernetes, while claims were prepared);
- a sweep, at start and with every check, removes the daemon Deployments of this node
  and the daemon directories that no journal entry owns, each with a Node Event and
  gpu_dra_mps_orphans_removed_total;
- a daemon pod replaced (a new pod UID) or restarted (its container's restarts) is
  reported as a loss: its clients' work is gone. A Warning Event on the claim and
  gpu_dra_mps_daemon_lost_total{outcome="replaced"}, once each."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from driver.kube.api import KubeApi
from driver.kube.mps_daemons import KubeDaemons
from driver.nvml.backend import NvmlBackend
from driver.nvml.mps import DaemonId, MpsControl, find_binary, is_running
from driver.observability import metrics
from driver.plugin.options.flags import parse_options
from driver.state.journal.checkpoint import Checkpoint
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.claim_daemons import ClaimMps
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from driver.state.mps_watch import REASON_LOST, MpsWatch
from tests.unit import test_mps_kube as kube
from tests.unit.test_mps_prepare import Node, mps_node, ok
from tests.unit.test_mps_watch import FLEET, Events, lost

ORPHAN = "0123456789abcdef"  # a daemon directory no journal entry names
OTHER_NODE = "node-b"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path, FLEET)


@pytest.fixture
def cluster_node(tmp_path: Path) -> kube.Node:
    return kube.Node(tmp_path)


class NodeEvents:
    """The Node Events the watch posts (reason, message)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def post(self, reason: str, message: str) -> None:
        self.events.append((reason, message))


def removed(kind: str) -> float:
    value = metrics.REGISTRY.get_sample_value("gpu_dra_mps_orphans_removed_total", {"kind": kind})
    assert value is not None, f"no series for kind {kind}"
    return value


def mps_root(root: Path) -> Path:
    return root / "plugin" / "mps"


def start_orphan(daemons: KubeDaemons, root: Path) -> MpsRecord:
    """A daemon of this node whose claim the journal no longer names (its entry
    lost), with its directories as a prepare made them."""
    record = MpsRecord("GPU-x", ORPHAN)
    dirs = daemon_dirs(root, record)
    for directory in (dirs.pipe, dirs.log, dirs.shm):
        assert directory is not None
        directory.mkdir(parents=True)
    return daemons.start(record, dirs)


# -- unprepare whatever the setting ----------------------------------------------------


def test_unprepare_stops_the_daemon_after_mps_was_turned_off(node: Node) -> None:
    ref = node.claims.add("a")
    ok(node.state(), ref)
    record = node.record("a")
    state = node.state(mps=False)  # the plugin restarts with --mps-daemons=off
    assert is_running(DaemonId(record.pid, record.start_time))  # left to its clients

    assert state.unprepare([ref]) == {"a": None}

    assert not is_running(DaemonId(record.pid, record.start_time))
    assert not (mps_root(node.root) / record.directory).exists()
    assert "a" not in Checkpoint(node.root / "plugin").load()


def test_unprepare_deletes_the_deployment_after_mps_was_turned_off(
    cluster_node: kube.Node,
) -> None:
    node = cluster_node
    ref = node.claims.add("a")
    ok(node.state(), ref)
    name = node.record("a").deployment
    state = node.state(mps=False)
    assert name in node.cluster.deployments

    assert state.unprepare([ref]) == {"a": None}

    assert node.cluster.deployments == {} and node.cluster.pods == {}
    assert "a" not in Checkpoint(node.root / "plugin").load()


def test_a_node_daemon_whose_binary_is_gone_is_stopped_by_signals(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """MPS turned off by removing nvidia-cuda-mps-control from the driver root: there
    is nothing to send `quit` with; the daemon the journal names gets SIGTERM."""
    ref = node.claims.add("a")
    ok(node.state(), ref)
    record = node.record("a")
    state = node.state(mps=False)
    without = MpsControl(node.root / "driver-root-without-mps")
    assert find_binary(without.driver_root) is None
    state.mps = ClaimMps(None, state.mps.root, others=(NodeDaemons(without),))

    with caplog.at_level(logging.WARNING):
        assert state.unprepare([ref]) == {"a": None}

    assert not is_running(DaemonId(record.pid, record.start_time))
    assert f"to quit the MPS control daemon {record.pid}: sending it SIGTERM" in caplog.text


def test_a_plugin_with_mps_off_can_still_stop_both_kinds_of_daemon() -> None:
    """The plugin's wiring (driver/plugin/mps_setup.py): with --mps-daemons=off in a
    pod, it keeps what stops a node process and what deletes a Deployment."""
    from driver.plugin.mps_setup import mps_others

    env = {
        "NODE_NAME": "n1", "POD_NAMESPACE": "gpu-dra-driver", "MPS_DAEMONS": "off",
        "MPS_DAEMON_IMAGE": "registry.example/gpu-dra-driver:1",
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        options = parse_options([])

    class Backend:
        def mps(self, driver_root: Path | str) -> None:
            return None  # not even the binary: a daemon is stopped by its signals

    others = mps_others(options, cast(NvmlBackend, Backend()), cast(KubeApi, None))
    assert sorted(o.kind for o in others) == ["kubernetes", "node"]
    (kube_daemons,) = [o for o in others if isinstance(o, KubeDaemons)]
    assert kube_daemons.settings.namespace == "gpu-dra-driver"
    assert kube_daemons.settings.node_name == "n1"


# -- the sweep -------------------------------------------------------------------------


def test_the_sweep_removes_the_deployments_and_directories_no_claim_owns(
    cluster_node: kube.Node,
) -> None:
    node = cluster_node
    state = node.state()
    ok(state, node.claims.add("a"))
    owned = node.record("a")
    daemons = node.daemons()
    root = mps_root(node.root)
    # A daemon of a claim the journal no longer names (its entry lost), and one of
    # another node's plugin in the same namespace.
    orphan = start_orphan(daemons, root)
    other_settings = replace(daemons.settings, node_name=OTHER_NODE)
    theirs = KubeDaemons(
        node.cluster, other_settings, clock=lambda: node.cluster.now, sleep=node.cluster.tick
    ).start(MpsRecord("GPU-y", ORPHAN), daemon_dirs(node.root / OTHER_NODE, orphan))
    (root / "aaaaaaaaaaaaaaaa" / "pipe").mkdir(parents=True)  # a directory only
    node_events = NodeEvents()
    counts = removed("deployment"), removed("directory")

    watch = MpsWatch(state, Events(), node_events=node_events.post)
    (seen,) = watch.check()

    assert seen.running
    assert set(node.cluster.deployments) == {owned.deployment, theirs.deployment}
    assert orphan.deployment not in node.cluster.pods  # its pod waited for
    assert [p.name for p in root.iterdir()] == [owned.directory]
    assert (removed("deployment"), removed("directory")) == (counts[0] + 1, counts[1] + 2)
    reasons = [r for r, _ in node_events.events]
    assert reasons == ["MPSOrphanRemoved"] * 3, node_events.events
    text = " ".join(m for _, m in node_events.events)
    assert f"Deployment {kube.NAMESPACE}/{orphan.deployment}" in text, text
    assert str(root / ORPHAN) in text and str(root / "aaaaaaaaaaaaaaaa") in text, text

    watch.check()  # nothing left to remove
    assert len(node_events.events) == 3


def test_the_sweep_stops_a_node_daemon_in_a_directory_no_claim_owns(node: Node) -> None:
    state = node.state()
    ok(state, node.claims.add("a"))
    owned = node.record("a")
    root = mps_root(node.root)
    dirs = daemon_dirs(root, MpsRecord("", ORPHAN))
    for directory in (dirs.pipe, dirs.log):
        directory.mkdir(parents=True)
    orphan = NodeDaemons(node.control).start(MpsRecord("GPU-x", ORPHAN), dirs)
    node_events = NodeEvents()

    MpsWatch(state, Events(), node_events=node_events.post).check()

    assert not is_running(DaemonId(orphan.pid, orphan.start_time))
    assert [p.name for p in root.iterdir()] == [owned.directory]
    assert node.daemons() == [owned.pid]
    ((reason, message),) = node_events.events
    assert reason == "MPSOrphanRemoved" and f"pid {orphan.pid}" in message, message


def test_with_mps_off_the_start_sweeps_once(cluster_node: kube.Node) -> None:
    node = cluster_node
    root = mps_root(node.root)
    daemons = node.daemons()
    orphan = start_orphan(daemons, root)
    state = node.state(mps=False)
    node_events = NodeEvents()

    MpsWatch(state, Events(), node_events=node_events.post).sweep()

    assert orphan.deployment not in node.cluster.deployments
    assert not (root / ORPHAN).exists()
    assert len(node_events.events) == 2


# -- a replaced pod is a loss ----------------------------------------------------------


def test_a_replaced_or_restarted_daemon_pod_is_reported_as_a_loss(
    cluster_node: kube.Node,
) -> None:
    node = cluster_node
    state = node.state()
    ref = node.claims.add("a")
    ok(state, ref)
    name = node.record("a").deployment
    events = Events()
    watch = MpsWatch(state, events)
    watch.check()
    assert events.events == []  # the pod it was created with
    before = lost("replaced")

    node.cluster.replace_pod(name)  # evicted or deleted: the controller made another
    (seen,) = watch.check()

    ((claim, reason, message),) = events.events
    assert (claim, reason) == (ref, REASON_LOST)
    assert "pod was replaced" in message and "lost their GPU work" in message, message
    assert f"Deployment {name}" in message and "device gpu-0" in message, message
    assert lost("replaced") == before + 1
    assert seen.running
    watch.check()  # reported once
    assert len(events.events) == 1

    node.cluster.restart_container(name)  # the daemon died; the kubelet restarted it
    watch.check()
    assert len(events.events) == 2 and "container restarted" in events.events[-1][2]
    assert lost("replaced") == before + 2


def test_a_pod_replaced_while_no_plugin_ran_is_reported_after_its_start(
    cluster_node: kube.Node,
) -> None:
    node = cluster_node
    ok(node.state(), node.claims.add("a"))
    node.cluster.replace_pod(node.record("a").deployment)
    state = node.state()  # the plugin starts again
    events = Events()

    MpsWatch(state, events).check()

    ((_, reason, message),) = events.events
    assert reason == REASON_LOST and "pod was replaced" in message, message


def test_a_daemon_started_under_another_setting_is_left_to_its_unprepare(node: Node) -> None:
    """Moved from node processes to Deployments: the node daemon the journal names is
    neither watched nor replaced by a Deployment (two daemons on one pipe directory)."""
    ref = node.claims.add("a")
    ok(node.state(), ref)
    record = node.record("a")
    cluster = kube.FakeCluster()
    settings = kube.Node(node.root).daemons().settings
    kube_daemons = KubeDaemons(cluster, settings, clock=lambda: cluster.now, sleep=cluster.tick)
    state = node.state(mps=False)
    state.mps = ClaimMps(kube_daemons, state.mps.root, others=(NodeDaemons(node.control),))

    assert MpsWatch(state, Events()).check() == ()
    assert cluster.deployments == {} and os.path.isdir(mps_root(node.root) / record.directory)
    assert state.unprepare([ref]) == {"a": None}
    assert not is_running(DaemonId(record.pid, record.start_time))
