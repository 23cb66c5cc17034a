"""SIGKILL at random moments while the kubelet prepares and unprepares claims.

Not the failpoints of tests/integration/test_prepare.py: a worker keeps issuing
prepare/unprepare calls back to back and the plugin is killed after a random delay,
wherever it happens to be. After each kill the plugin restarts on the same
directories and the kubelet retries the interrupted call (as the real kubelet does
until it succeeds); then the local state must be exactly what the kubelet believes.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

from tests.conftest import Cluster, FakeNode
from tests.integration.kubelet_standin import ClaimRef, KubeletStandin, KubeletStandinError
from tests.integration.plugin_process import DRIVER
from tests.reliability.support import (
    allocated_claim,
    api_for,
    assert_consistent,
    dump_state,
    ensure_namespace,
    start_instance,
)

NS = "reliability-kill"
KILLS = 12
CLAIMS = 6


class Worker(threading.Thread):
    """Random prepare/unprepare calls until one fails (the plugin died)."""

    def __init__(
        self, kubelet: KubeletStandin, refs: list[ClaimRef], prepared: set[str], rng: random.Random
    ) -> None:
        super().__init__(daemon=True)
        self.kubelet = kubelet
        self.refs = refs
        self.prepared = prepared
        self.rng = rng
        self.pending: tuple[str, list[ClaimRef]] | None = None
        self.calls = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            free = [r for r in self.refs if r.uid not in self.prepared]
            held = [r for r in self.refs if r.uid in self.prepared]
            if held and (not free or self.rng.random() < 0.5):
                op, batch = "unprepare", self.rng.sample(held, self.rng.randint(1, len(held)))
            else:
                op, batch = "prepare", self.rng.sample(free, self.rng.randint(1, len(free)))
            self.pending = (op, batch)
            try:
                result = getattr(self.kubelet, op)(DRIVER, batch, timeout=10)
            except KubeletStandinError:
                return  # the plugin died under this call: it stays pending
            except BaseException as err:
                self.error = err
                return
            errors = {uid: r.error for uid, r in result.items() if r.error}
            if errors:
                self.error = AssertionError(f"{op} failed without a kill: {errors}")
                return
            for r in batch:
                (self.prepared.add if op == "prepare" else self.prepared.discard)(r.uid)
            self.pending = None
            self.calls += 1


def test_sigkill_at_random_moments(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    rng = random.Random(20260801)
    api = api_for(cluster)
    ensure_namespace(api, NS)
    refs = [allocated_claim(api, node.name, NS, f"kill-{i}", f"gpu-{i}") for i in range(CLAIMS)]
    prepared: set[str] = set()
    in_flight = 0
    pending: tuple[str, list[ClaimRef]] | None = None
    for kill in range(KILLS):
        inst = start_instance(cluster, node, root)
        try:
            if pending is not None:
                in_flight += 1
                op, batch = pending
                # The kubelet retries the interrupted call until it succeeds.
                result = getattr(inst.kubelet, op)(DRIVER, batch, timeout=30)
                errors = {uid: r.error for uid, r in result.items() if r.error}
                assert not errors, f"retried {op} failed after kill {kill}: {errors}"
                for r in batch:
                    (prepared.add if op == "prepare" else prepared.discard)(r.uid)
            try:
                assert_consistent(inst.plugin, prepared)
            except AssertionError as err:
                raise AssertionError(
                    f"before kill {kill}: {err}\n{dump_state(inst.plugin)}"
                ) from err
            worker = Worker(inst.kubelet, refs, prepared, rng)
            worker.start()
            time.sleep(rng.uniform(0.05, 0.5))
            assert worker.error is None, worker.error
            inst.plugin.kill()
            worker.join(timeout=15)
            assert not worker.is_alive(), "a call hung after the plugin was killed"
            assert worker.error is None, worker.error
            figures["kill loop: calls completed between kills"] += worker.calls
            pending = worker.pending
        finally:
            inst.stop()
        figures["kill loop: SIGKILLs survived"] += 1
    figures["kill loop: kills that hit an in-flight call"] += in_flight + (pending is not None)

    # Nothing is double-booked: a second claim on a device held by a prepared claim is
    # refused with a clear transient error, and everything unprepares cleanly at the end.
    inst = start_instance(cluster, node, root)
    try:
        if pending is not None:
            op, batch = pending
            result = getattr(inst.kubelet, op)(DRIVER, batch, timeout=30)
            assert not any(r.error for r in result.values()), result
            for r in batch:
                (prepared.add if op == "prepare" else prepared.discard)(r.uid)
        assert_consistent(inst.plugin, prepared)
        holder = next((r for r in refs if r.uid in prepared), refs[0])
        if holder.uid not in prepared:
            assert not inst.kubelet.prepare(DRIVER, [holder])[holder.uid].error
            prepared.add(holder.uid)
        device = f"gpu-{refs.index(holder)}"
        intruder = allocated_claim(api, node.name, NS, "kill-intruder", device)
        refused = inst.kubelet.prepare(DRIVER, [intruder])[intruder.uid]
        assert "refusing to hand it to a second claim" in refused.error, refused.error
        assert not refused.error.startswith("permanent")
        result = inst.kubelet.unprepare(DRIVER, refs)
        assert not any(r.error for r in result.values())
        assert_consistent(inst.plugin, set())
    finally:
        inst.stop()
