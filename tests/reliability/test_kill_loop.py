"""SIGKILL at random moments while the kubelet prepares and unprepares claims.

Not the failpoints of tests/integration/test_prepare.py: a worker keeps issuing
prepare/unprepare calls back to back and the plugin is killed after a random delay,
wherever it happens to be. After each kill the plugin restarts on the same
directories and the kubelet retries the interrupted call (as the real kubelet does
until it succeeds); then the local state must be exactly what the kubelet believes.

The claims' devices overlap in every way the node must tell apart: a whole GPU and
one of its MIG partitions, two MIG placements of one GPU whose memory slices
intersect (3g at slice 0 and 1g at slice 2), and two shares of one device, a GPU not
in MIG mode published with allowMultipleAllocations (`--gpu-allow-multiple-allocations`;
they may be held together; a MIG-mode GPU is delivered as a MIG device of the
full-size profile, which exists once and is never shared). The mock fleet: MIG GPUs plus one GPU
with MIG disabled. A prepare may therefore be refused ("refusing to hand it to a
second claim"), but only for a claim whose hardware a prepared claim holds; and no
two claims may ever hold the same hardware, by the answers and by the journal
(`assert_consistent` compares GPUs and memory-slice ranges, not device names).

The only acceptable way for a call to fail is the plugin dying under it: UNAVAILABLE
or CANCELLED, after the kill. Any other status, a response the kubelet rejects, or a
failure before the kill fails the test.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from driver.devices.model import PoolDevices, PublishedDevice
from driver.kube.api import KubeApi
from driver.proto.dra.v1 import api_pb2
from tests.conftest import Cluster, FakeNode
from tests.integration.kubelet_standin import ClaimRef, KubeletStandin, KubeletStandinError
from tests.integration.plugin_process import DRIVER, PluginProcess
from tests.reliability.support import (
    Holding,
    allocated_claim,
    api_for,
    assert_consistent,
    conflicting,
    describe_device,
    dump_state,
    ensure_namespace,
    published_pool,
    start_instance,
)

NS = "reliability-kill"
KILLS = 12
REFUSAL = "refusing to hand it to a second claim"
# How a call fails when the plugin dies under it (connection reset or refused).
DIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
SHARE_IDS = ("5a1e0000-0000-4000-8000-00000000000a", "5a1e0000-0000-4000-8000-00000000000b")
FLEET = {
    "gpus": [
        {"model": "H100-80GB", "count": 3},
        {"model": "H100-80GB", "count": 1, "migMode": "disabled"},
    ]
}


@dataclass(frozen=True)
class Claims:
    """The test's claims, the hardware each holds, and the rules for an answer."""

    pool: PoolDevices
    refs: list[ClaimRef]
    holding: dict[str, Holding]  # by UID

    def conflict(self, a: str, b: str) -> bool:
        return a != b and conflicting(self.pool, self.holding[a], self.holding[b])

    def show(self, uid: str) -> str:
        ref = next(r for r in self.refs if r.uid == uid)
        held = self.holding[uid]
        share = f" (share {held.share_id})" if held.share_id else ""
        return f"claim {ref.name} with {describe_device(self.pool, held.device)}{share}"

    def apply(
        self,
        op: str,
        batch: list[ClaimRef],
        result: Mapping[str, Any],
        prepared: set[str],
    ) -> list[str]:
        """Record one answered call in `prepared`; return what is wrong with the answer.

        Unprepare always succeeds. Prepare succeeds unless the claim's hardware is held
        by a prepared claim (or one prepared by the same call): then, and only then, it
        is refused with a transient error. Two claims holding one piece of hardware is
        the double-booking this test exists to catch."""
        problems: list[str] = []
        if op == "unprepare":
            for r in batch:
                if result[r.uid].error:
                    problems.append(f"unprepare of {r.name} failed: {result[r.uid].error}")
                else:
                    prepared.discard(r.uid)
            return problems
        got = {r.uid for r in batch if not result[r.uid].error}
        holders = prepared | got
        for r in batch:
            answer = result[r.uid]
            rivals = sorted(u for u in holders if self.conflict(u, r.uid))
            if answer.error:
                if rivals and REFUSAL not in answer.error:
                    problems.append(
                        f"prepare of {r.name} failed with an error other than the node's "
                        f"refusal although "
                        + ", ".join(self.show(u) for u in rivals)
                        + f" holds the same hardware (the double-booking guard let "
                        f"{self.show(r.uid)} through): {answer.error}"
                    )
                elif not rivals:
                    problems.append(f"prepare of {r.name} failed: {answer.error}")
                elif answer.error_type == api_pb2.Permanent:
                    problems.append(f"refusal of {r.name} is permanent: {answer.error}")
            elif rivals:
                problems.append(
                    f"{self.show(r.uid)} was prepared although "
                    + ", ".join(self.show(u) for u in rivals)
                    + " holds the same hardware: the node handed it to two claims"
                )
        prepared |= got
        return problems


def _claims(api: KubeApi, node: str, pool: PoolDevices) -> Claims:
    """Seven claims on three MIG GPUs and one GPU without MIG of the published pool
    (placement and parent GPU from the pool's devices, not from their names)."""
    gpus = list(dict.fromkeys(d.gpu_uuid for d in pool.devices if d.placement is not None))
    assert len(gpus) >= 3, f"the mock fleet needs 3 GPUs with MIG placements, has {len(gpus)}"
    plain = [d for d in pool.devices if len(pool.devices_of_gpu(d.gpu_uuid)) == 1]
    assert plain, "the mock fleet needs a GPU without partitions"

    def whole(gpu: str) -> PublishedDevice:
        return next(d for d in pool.devices_of_gpu(gpu) if not d.is_partition)

    def placed(gpu: str, profile: str, start: int) -> PublishedDevice:
        return next(
            d
            for d in pool.devices_of_gpu(gpu)
            if d.profile is not None
            and d.profile.startswith(profile)
            and d.placement is not None
            and d.placement[0] == start
        )

    wanted = [
        ("kill-gpu", Holding(whole(gpus[0]).name)),
        ("kill-gpu-part", Holding(placed(gpus[0], "1g.", 3).name)),
        ("kill-share-a", Holding(plain[0].name, SHARE_IDS[0])),
        ("kill-share-b", Holding(plain[0].name, SHARE_IDS[1])),
        ("kill-3g", Holding(placed(gpus[1], "3g.", 0).name)),
        ("kill-1g", Holding(placed(gpus[1], "1g.", 2).name)),
        ("kill-solo", Holding(whole(gpus[2]).name)),
    ]
    refs: list[ClaimRef] = []
    holding: dict[str, Holding] = {}
    for name, held in wanted:
        ref = allocated_claim(api, node, NS, name, held.device, held.share_id)
        refs.append(ref)
        holding[ref.uid] = held
    claims = Claims(pool, refs, holding)
    # The premise: exactly these pairs share hardware.
    pairs = {
        (a.name, b.name)
        for a, b in itertools.combinations(refs, 2)
        if claims.conflict(a.uid, b.uid)
    }
    assert pairs == {("kill-gpu", "kill-gpu-part"), ("kill-3g", "kill-1g")}, pairs
    return claims


def _same_gpu_pairs(claims: Claims) -> list[tuple[ClaimRef, ClaimRef]]:
    pool = claims.pool
    return [
        (a, b)
        for a, b in itertools.combinations(claims.refs, 2)
        if pool.device(claims.holding[a.uid].device).gpu_uuid
        == pool.device(claims.holding[b.uid].device).gpu_uuid
    ]


def _checked(
    plugin: PluginProcess,
    claims: Claims,
    op: str,
    batch: list[ClaimRef],
    result: Mapping[str, Any],
    prepared: set[str],
    when: str,
) -> None:
    """The journal and CDI specs first (hardware held once), then the answer."""
    try:
        assert_consistent(plugin)
    except AssertionError as err:
        names = [r.name for r in batch]
        raise AssertionError(f"{when}, after {op} {names}: {err}\n{dump_state(plugin)}") from err
    problems = claims.apply(op, batch, result, prepared)
    assert not problems, f"{when}: " + "\n".join(problems)
    assert_consistent(plugin, prepared)


def _walk_overlaps(inst_plugin: PluginProcess, kubelet: KubeletStandin, claims: Claims) -> None:
    """Every pair of claims on one GPU, one after the other both ways and in one call."""
    prepared: set[str] = set()

    def step(op: str, batch: list[ClaimRef]) -> None:
        result: Mapping[str, Any] = getattr(kubelet, op)(DRIVER, batch)
        _checked(inst_plugin, claims, op, batch, result, prepared, "pair walk")

    for a, b in _same_gpu_pairs(claims):
        for first, second in ((a, b), (b, a)):
            step("prepare", [first])
            step("prepare", [second])
            step("unprepare", [a, b])
        step("prepare", [a, b])
        step("unprepare", [a, b])


class Worker(threading.Thread):
    """Random prepare/unprepare calls until the plugin is killed under one."""

    def __init__(
        self,
        kubelet: KubeletStandin,
        claims: Claims,
        prepared: set[str],
        rng: random.Random,
        killed: threading.Event,
    ) -> None:
        super().__init__(daemon=True)
        self.kubelet = kubelet
        self.claims = claims
        self.prepared = prepared
        self.rng = rng
        self.killed = killed
        self.pending: tuple[str, list[ClaimRef]] | None = None
        self.calls = 0
        self.refused = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        refs = self.claims.refs
        while True:
            free = [r for r in refs if r.uid not in self.prepared]
            held = [r for r in refs if r.uid in self.prepared]
            if held and (not free or self.rng.random() < 0.5):
                op, batch = "unprepare", self.rng.sample(held, self.rng.randint(1, len(held)))
            else:
                op, batch = "prepare", self.rng.sample(free, self.rng.randint(1, len(free)))
            self.pending = (op, batch)
            try:
                result = getattr(self.kubelet, op)(DRIVER, batch, timeout=10)
            except KubeletStandinError as err:
                cause = err.__cause__
                if (
                    self.killed.is_set()
                    and isinstance(cause, grpc.RpcError)
                    and cause.code() in DIED
                ):
                    return  # the plugin died under this call: it stays pending
                when = "after" if self.killed.is_set() else "before"
                names = [r.name for r in batch]
                self.error = AssertionError(f"{op} {names} failed {when} the kill: {err}")
                return
            except BaseException as err:
                self.error = err
                return
            before = len(self.prepared)
            problems = self.claims.apply(op, batch, result, self.prepared)
            if problems:
                self.error = AssertionError("\n".join(problems))
                return
            if op == "prepare":
                self.refused += len(batch) - (len(self.prepared) - before)
            self.pending = None
            self.calls += 1


RETRIES: int = 3


def _retried(call: Any, *args: Any, **kwargs: Any) -> Any:
    """`call(...)`, again where its channel closed under it (the stand-in, like the kubelet,
    re-dials a plugin whose registration socket was renewed): as the kubelet does, the
    retry is the same request. Seen once in CI under load, on the first call after a
    restart (`CANCELLED: Channel closed!`)."""
    for attempt in range(RETRIES):
        try:
            return call(*args, **kwargs)
        except KubeletStandinError as err:
            if "CANCELLED" not in str(err) or attempt == RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def test_sigkill_at_random_moments(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    rng = random.Random(20260801)
    api = api_for(cluster)
    ensure_namespace(api, NS)
    fleet = root / "fleet.json"
    fleet.write_text(json.dumps(FLEET))
    # Sharing on, as the shares' allocations require (consumable capacity).
    args = [f"--mock-fleet={fleet}", "--gpu-allow-multiple-allocations"]

    # The pairs on one GPU, deterministically; then the whole GPU, the 3g placement
    # and one share stay prepared across a SIGKILL into the loop.
    inst = start_instance(cluster, node, root, args=args)
    try:
        claims = _claims(api, node.name, published_pool(inst.plugin))
        _walk_overlaps(inst.plugin, inst.kubelet, claims)
        prepared: set[str] = set()
        first = [r for r in claims.refs if r.name in ("kill-gpu", "kill-share-a", "kill-3g")]
        result = inst.kubelet.prepare(DRIVER, first)
        _checked(inst.plugin, claims, "prepare", first, result, prepared, "before the loop")
        assert prepared == {r.uid for r in first}
        inst.plugin.kill()
    finally:
        inst.stop()

    in_flight = 0
    refused = 0
    pending: tuple[str, list[ClaimRef]] | None = None
    for kill in range(KILLS):
        inst = start_instance(cluster, node, root, args=args)
        try:
            if pending is not None:
                in_flight += 1
                op, batch = pending
                # The kubelet retries the interrupted call until it succeeds.
                result = _retried(getattr(inst.kubelet, op), DRIVER, batch, timeout=30)
                _checked(
                    inst.plugin, claims, op, batch, result, prepared, f"retry after kill {kill}"
                )
            try:
                assert_consistent(inst.plugin, prepared)
            except AssertionError as err:
                raise AssertionError(
                    f"before kill {kill}: {err}\n{dump_state(inst.plugin)}"
                ) from err
            killed = threading.Event()
            worker = Worker(inst.kubelet, claims, prepared, rng, killed)
            worker.start()
            time.sleep(rng.uniform(0.05, 0.5))
            assert worker.error is None, worker.error
            killed.set()
            inst.plugin.kill()
            worker.join(timeout=15)
            assert not worker.is_alive(), "a call hung after the plugin was killed"
            assert worker.error is None, worker.error
            figures["kill loop: calls completed between kills"] += worker.calls
            refused += worker.refused
            pending = worker.pending
        finally:
            inst.stop()
        figures["kill loop: SIGKILLs survived"] += 1
    figures["kill loop: kills that hit an in-flight call"] += in_flight + (pending is not None)
    figures["kill loop: overlapping prepares refused"] += refused

    # After the last kill: every claim not prepared is asked for in one call. Of each
    # pair on one GPU exactly one ends up held, both shares are held, and every
    # refusal names hardware another claim holds.
    inst = start_instance(cluster, node, root, args=args)
    try:
        if pending is not None:
            op, batch = pending
            result = getattr(inst.kubelet, op)(DRIVER, batch, timeout=30)
            _checked(inst.plugin, claims, op, batch, result, prepared, "retry after the loop")
        assert_consistent(inst.plugin, prepared)
        rest = [r for r in claims.refs if r.uid not in prepared]
        if rest:
            answers = inst.kubelet.prepare(DRIVER, rest)
            _checked(inst.plugin, claims, "prepare", rest, answers, prepared, "after the loop")
        held = {r.name for r in claims.refs if r.uid in prepared}
        assert len(held & {"kill-gpu", "kill-gpu-part"}) == 1, held
        assert len(held & {"kill-3g", "kill-1g"}) == 1, held
        assert {"kill-share-a", "kill-share-b", "kill-solo"} <= held, held
        done = inst.kubelet.unprepare(DRIVER, claims.refs)
        _checked(inst.plugin, claims, "unprepare", claims.refs, done, prepared, "at the end")
        assert_consistent(inst.plugin, set())
    finally:
        inst.stop()
