"""Two plugin instances of one node publishing different content on the real
kube-apiserver, as during a rolling update: whatever the interleaving of their writes
and whenever the new one registers or the old one exits, the newest registered
instance's content is what stays published (docs/rolling-updates.md).

Each round starts an old instance that keeps rewriting its slices (a taint flipping
on a device, as an Xid storm would), then a new instance with other content (another
attribute value), registers the new one after a random delay, and stops the old one
at a random moment, or never. The bound on convergence is taken from this run: a
multiple of how long one publisher took to publish the same content alone.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.kube.api import KubeApi
from driver.kube.publisher import SLICES_PATH, SlicePublisher
from driver.plugin import serving_instance
from driver.plugin.serving_instance import Succession
from tests.conftest import Cluster, FakeNode
from tests.integration.plugin_process import DRIVER

ROUNDS = 12
DEVICES_PER_SLICE = 3
SLICES = 2
# Convergence may take this many baseline publishes, plus the watch's poll.
BOUND_FACTOR = 20
# How long the old instance's writes are watched after convergence: the content
# must stay the new one.
HOLD_FACTOR = 5


def content(node: str, mps: bool, round_: int, taint_on: bool = False) -> list[dict[str, Any]]:
    specs = []
    for s in range(SLICES):
        devices = []
        for d in range(DEVICES_PER_SLICE):
            device: dict[str, Any] = {
                "name": f"gpu-{s * DEVICES_PER_SLICE + d}",
                "attributes": {"mps": {"bool": mps}, "round": {"int": round_}},
                "capacity": {"memory": {"value": "80Gi"}},
            }
            if taint_on and s == 0 and d == 0:
                device["taints"] = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
            devices.append(device)
        specs.append(
            {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 0, "resourceSliceCount": 0},
                "devices": devices,
            }
        )
    return specs


def published(api: KubeApi, node: str) -> dict[str, tuple[bool, int]]:
    """device -> (mps, round) in the pool's newest generation."""
    query = {"fieldSelector": f"spec.driver={DRIVER},spec.nodeName={node}"}
    items = api.request("GET", SLICES_PATH, query=query, strict=False).get("items", [])
    if not items:
        return {}
    newest = max(s["spec"]["pool"]["generation"] for s in items)
    return {
        d["name"]: (d["attributes"]["mps"]["bool"], d["attributes"]["round"]["int"])
        for s in items
        if s["spec"]["pool"]["generation"] == newest
        for d in s["spec"].get("devices") or []
    }


def wanted(mps: bool, round_: int) -> dict[str, tuple[bool, int]]:
    return {f"gpu-{i}": (mps, round_) for i in range(SLICES * DEVICES_PER_SLICE)}


def wait(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `predicate()` held, or None after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


class Instance:
    """A plugin instance's publisher and place, as driver.plugin.main wires them."""

    def __init__(self, api: KubeApi, node: str, data_dir: Path, desired: Callable[[], Any]):
        self.succession = Succession(data_dir, holder=f"instance {id(self)}")
        self.publisher = SlicePublisher(
            api,
            driver=DRIVER,
            node_name=node,
            desired=desired,
            may_write=self.succession.serving,
        )
        self.succession.on_change(lambda serving: serving and self.publisher.trigger())

    def start(self) -> None:
        self.succession.start()
        self.succession.watch()
        self.publisher.start()

    def stop(self) -> None:
        self.publisher.stop()
        self.succession.stop()


@pytest.fixture
def api(cluster: Cluster) -> KubeApi:
    return KubeApi.from_kubeconfig(str(cluster.kubeconfig))


@pytest.fixture
def running() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for i in made:
        i.stop()


def test_the_newest_registered_instance_content_remains_however_the_writes_interleave(
    api: KubeApi, node: FakeNode, tmp_path: Path, running: list[Instance]
) -> None:
    rng = random.Random(41)
    # Baseline: one publisher alone publishing a content the pool did not have.
    (tmp_path / "baseline").mkdir()
    alone = Instance(api, node.name, tmp_path / "baseline", lambda: content(node.name, False, -1))
    running.append(alone)
    started = time.monotonic()
    alone.start()
    assert wait(lambda: published(api, node.name) == wanted(False, -1), 120) is not None
    baseline = time.monotonic() - started
    alone.stop()
    bound = BOUND_FACTOR * baseline + 2 * serving_instance.POLL_SECONDS
    print(f"\nbaseline publish {baseline:.3f}s; convergence bound {bound:.3f}s")

    rounds = [tmp_path / f"round-{r}" for r in range(ROUNDS)]
    for data_dir in rounds:
        data_dir.mkdir()
    converged = [
        one_round(api, node.name, data_dir, r, rng, bound, baseline, running)
        for r, data_dir in enumerate(rounds)
    ]
    print(
        f"{ROUNDS} rounds: new content published {min(converged):.3f}s to "
        f"{max(converged):.3f}s after the registration (bound {bound:.3f}s)"
    )


def one_round(
    api: KubeApi,
    node: str,
    data_dir: Path,
    round_: int,
    rng: random.Random,
    bound: float,
    baseline: float,
    running: list[Instance],
) -> float:
    """One interleaving; returns seconds from the new instance's registration to its
    content published."""
    flip = {"on": False}
    old = Instance(api, node, data_dir, lambda: content(node, False, round_, flip["on"]))
    new = Instance(api, node, data_dir, lambda: content(node, True, round_))
    running.extend([old, new])
    old.start()
    assert wait(lambda: published(api, node) == wanted(False, round_), bound)

    storm = threading.Event()

    def xid_storm() -> None:
        while not storm.is_set():
            flip["on"] = not flip["on"]
            old.publisher.trigger()
            time.sleep(rng.uniform(0, 0.02))

    stormer = threading.Thread(target=xid_storm, daemon=True)
    stormer.start()
    new.start()  # waits: the old instance serves
    time.sleep(rng.uniform(0, 0.3))
    assert not new.succession.serving()
    registered = time.monotonic()
    new.succession.registered()
    old_exits_after = rng.choice([None, rng.uniform(0, 0.5)])
    if old_exits_after is not None:
        time.sleep(old_exits_after)
        storm.set()
        old.stop()
    took = wait(lambda: published(api, node) == wanted(True, round_), bound)
    assert took is not None, (
        f"round {round_}: the new content was not published within {bound:.2f}s "
        f"(published: {published(api, node)})"
    )
    converged = time.monotonic() - registered
    # It stays: the old instance's triggers keep coming and write nothing.
    deadline = time.monotonic() + HOLD_FACTOR * baseline + serving_instance.POLL_SECONDS
    while time.monotonic() < deadline:
        assert published(api, node) == wanted(True, round_), f"round {round_}"
        time.sleep(0.05)
    storm.set()
    stormer.join()
    old.stop()
    new.stop()
    return converged
