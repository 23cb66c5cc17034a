"""Concurrent and overlapping calls: two plugin instances of a rolling update on the
same directories, and 100 overlapping prepare/unprepare calls at once on one instance.
Both must serialise: no device handed to two claims, CDI specs == journal, every
unprepare succeeds, and every prepare answer is either success or the transient
double-booking refusal naming the claim that holds the device. No lock timeout: the
node lock (10 s) is held for milliseconds per call, so a timeout here would mean a
call stuck under it."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from driver.proto.dra.v1 import api_pb2
from tests.conftest import Cluster, FakeNode
from tests.integration.kubelet_standin import ClaimRef, RegisteredPlugin
from tests.integration.plugin_process import DRIVER
from tests.reliability.support import (
    allocated_claim,
    api_for,
    assert_consistent,
    ensure_namespace,
    prepare_request,
    start_instance,
    stub,
    unprepare_request,
)

NS = "reliability-concurrency"
YIELDED = "serves this node now and this one has yielded to it"
JOIN_TIMEOUT = 120.0  # seconds for all 100 concurrent calls to finish


@dataclass(frozen=True)
class Allocated:
    """A claim and the one device it is allocated."""

    ref: ClaimRef
    device: str


def _check_refusal(
    claim: Allocated,
    claims: list[Allocated],
    batch: list[ClaimRef],
    message: str,
    error_type: int,
) -> None:
    """The only error a prepare here may get: the transient double-booking refusal
    (driver/state/booking.py) naming the other claim allocated the same device, whose
    journal entry is completed, or just started when it came in the same request."""
    assert error_type != api_pb2.Permanent, message
    holder = next(c.ref for c in claims if c.device == claim.device and c.ref != claim.ref)
    states = ("PrepareCompleted", "PrepareStarted") if holder in batch else ("PrepareCompleted",)
    expected = [
        f"device {claim.device} overlaps device {claim.device} already prepared for claim "
        f"{NS}/{holder.name} ({holder.uid}, {state}); refusing to hand it to a "
        f"second claim ({claim.ref.uid})"
        for state in states
    ]
    assert message in expected, f"unexpected error for {claim.ref.name}: {message}"


def test_rolling_update_two_instances_take_concurrent_calls(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    """Two instances (--pod-uid a/b, the same dirs) both registered; four kubelet
    threads each own two claims and send them, at random, to either instance. Claims
    of different threads want the same devices, so half the prepares must be refused.
    One instance serves the node (the one registered last, docs/rolling-updates.md):
    the other refuses every prepare with the retryable error naming it, and still
    unprepares, concurrently with the serving one's prepares."""
    api = api_for(cluster)
    ensure_namespace(api, NS)
    # thread t owns claims on gpu-t and gpu-(t+1)%4: every device is wanted by two threads
    owned = [
        [
            Allocated(
                allocated_claim(api, node.name, NS, f"ru-{t}-{k}", f"gpu-{(t + k) % 4}"),
                f"gpu-{(t + k) % 4}",
            )
            for k in range(2)
        ]
        for t in range(4)
    ]
    claims = [c for mine in owned for c in mine]
    old = start_instance(cluster, node, root, args=["--pod-uid=old-pod"])
    new = start_instance(cluster, node, root, args=["--pod-uid=new-pod"])
    try:
        # Both instances register (the new one's stand-in sees both sockets).
        def both_registered() -> dict[str, RegisteredPlugin] | None:
            plugins = new.kubelet.plugins
            return plugins if len(plugins) == 2 else None

        both = cluster.wait_for(both_registered, 30, "both instances registered")
        instances: list[RegisteredPlugin] = sorted(both.values(), key=lambda p: p.endpoint)
        assert [Path(p.endpoint).name for p in instances] == [
            "dra-new-pod.sock",
            "dra-old-pod.sock",
        ]
        assert instances[0].endpoint != instances[1].endpoint
        counts = Counter[str]()
        failures: list[BaseException] = []
        lock = threading.Lock()

        answered: set[tuple[str, str]] = set()  # (instance endpoint, outcome)

        def run(t: int) -> set[str]:
            rng = random.Random(t)
            mine: set[str] = set()
            for _ in range(25):
                claim = rng.choice(owned[t])
                ref = claim.ref
                instance = rng.choice(instances)
                target = stub(instance)
                if ref.uid in mine:
                    resp = target.NodeUnprepareResources(unprepare_request([ref]), timeout=30)
                    assert resp.claims[ref.uid].error == "", resp.claims[ref.uid].error
                    mine.discard(ref.uid)
                    key = "unprepared"
                else:
                    resp = target.NodePrepareResources(prepare_request([ref]), timeout=30)
                    result = resp.claims[ref.uid]
                    if YIELDED in result.error:
                        assert result.error_type != api_pb2.Permanent, result.error
                        key = "yielded"
                    elif result.error:
                        _check_refusal(claim, claims, [ref], result.error, result.error_type)
                        key = "refused"
                    else:
                        mine.add(ref.uid)
                        key = "prepared"
                with lock:
                    counts[key] += 1
                    answered.add((instance.endpoint, key))
            return mine

        def guarded(t: int) -> set[str]:
            try:
                return run(t)
            except BaseException as err:
                failures.append(err)
                return set()

        with ThreadPoolExecutor(4) as pool:
            held = set().union(*pool.map(guarded, range(4)))
        assert not failures, failures[0]
        old.plugin.check_alive()
        new.plugin.check_alive()
        state = assert_consistent(new.plugin, held)
        assert len(state.completed) <= 4  # four devices
        assert counts["refused"] > 0, counts  # the overlap really happened
        # One instance serves: it never yields; the other never prepares.
        yielding = {endpoint for endpoint, key in answered if key == "yielded"}
        preparing = {endpoint for endpoint, key in answered if key == "prepared"}
        assert len(yielding) == 1 and not yielding & preparing, answered
        assert "unprepared" in {k for e, k in answered if e in yielding}, answered
        figures["rolling update: calls across two instances"] += sum(counts.values())
        figures["rolling update: double-bookings refused"] += counts["refused"]

        # The old instance goes away; the new one carries on with the same state.
        old.stop()
        everything = [c.ref for c in claims]
        resp = stub(instances[0]).NodeUnprepareResources(unprepare_request(everything), timeout=30)
        assert all(c.error == "" for c in resp.claims.values())
        assert_consistent(new.plugin, set())
    finally:
        old.stop()
        new.stop()


def test_100_concurrent_overlapping_calls(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    """100 calls at once from 100 threads: prepares and unprepares of overlapping sets
    of 8 claims (two claims per device), repeated claims within and across calls."""
    api = api_for(cluster)
    ensure_namespace(api, NS)
    claims = [
        Allocated(allocated_claim(api, node.name, NS, f"cc-{i}", f"gpu-{i % 4}"), f"gpu-{i % 4}")
        for i in range(8)
    ]
    refs = [c.ref for c in claims]
    by_uid = {c.ref.uid: c for c in claims}
    inst = start_instance(cluster, node, root)
    try:
        target = stub(inst.kubelet.plugin(DRIVER))
        rng = random.Random(100)
        calls: list[tuple[str, list[ClaimRef]]] = [
            (rng.choice(("prepare", "unprepare")), rng.sample(refs, rng.randint(1, 4)))
            for _ in range(100)
        ]
        barrier = threading.Barrier(100)
        outcomes = Counter[str]()
        failures: list[BaseException] = []
        lock = threading.Lock()

        def call(op: str, batch: list[ClaimRef]) -> None:
            try:
                barrier.wait(timeout=30)
                if op == "prepare":
                    resp = target.NodePrepareResources(prepare_request(batch), timeout=60)
                else:
                    resp = target.NodeUnprepareResources(unprepare_request(batch), timeout=60)
                assert set(resp.claims) == {r.uid for r in batch}, "a claim was left out"
                for uid, result in resp.claims.items():
                    if op == "unprepare":
                        assert result.error == "", f"unprepare of {uid}: {result.error}"
                    elif result.error:
                        _check_refusal(by_uid[uid], claims, batch, result.error, result.error_type)
                with lock:
                    for result in resp.claims.values():
                        outcomes[f"{op} {'error' if result.error else 'ok'}"] += 1
            except BaseException as err:
                failures.append(err)

        # Daemon threads: a hung call must fail the test, not keep pytest from exiting.
        threads = [
            threading.Thread(
                target=call,
                args=(op, batch),
                name=f"call-{i}-{op}-{'+'.join(r.name for r in batch)}",
                daemon=True,
            )
            for i, (op, batch) in enumerate(calls)
        ]
        for th in threads:
            th.start()
        # One deadline for all of them (not JOIN_TIMEOUT each): every call has a 60 s
        # gRPC deadline, so a thread still alive after that did not finish at all.
        deadline = time.monotonic() + JOIN_TIMEOUT
        for th in threads:
            th.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [th.name for th in threads if th.is_alive()]
        assert not hung, f"{len(hung)} call(s) still running after {JOIN_TIMEOUT}s: {hung}"
        assert not failures, failures[0]
        inst.plugin.check_alive()
        state = assert_consistent(inst.plugin)
        for uid, devices in state.completed.items():
            ref = next(r for r in refs if r.uid == uid)
            assert devices == [f"gpu-{refs.index(ref) % 4}"]
        figures["concurrency: overlapping calls at once"] += len(calls)
        figures["concurrency: claim results checked"] += sum(outcomes.values())

        # Afterwards the state is usable: unprepare everything, then one claim per device.
        assert all(
            c.error == ""
            for c in target.NodeUnprepareResources(
                unprepare_request(refs), timeout=30
            ).claims.values()
        )
        assert_consistent(inst.plugin, set())
        first = refs[:4]
        resp = target.NodePrepareResources(prepare_request(first), timeout=30)
        assert all(c.error == "" for c in resp.claims.values())
        assert_consistent(inst.plugin, {r.uid for r in first})
        target.NodeUnprepareResources(unprepare_request(first), timeout=30)
    finally:
        inst.stop()
