"""Fuzzed gRPC requests against the plugin's DRA socket: empty, duplicate, unknown
UIDs, huge batches, random strings and random bytes. Every claim gets a clear error
(or success), malformed messages get a gRPC status, and the plugin never crashes nor
touches anything outside its directories."""

from __future__ import annotations

import random
import string
from collections import Counter
from pathlib import Path

import grpc

from driver.proto.dra.v1 import api_pb2
from tests.conftest import Cluster, FakeNode
from tests.integration.kubelet_standin import ClaimRef
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

NS = "reliability-fuzz"
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
ALPHABET = string.printable + "äöü日本語\u202e\u200b/..\\%"


def _clear(message: str) -> None:
    assert message.strip(), "an empty error message"
    assert "Traceback" not in message, message
    assert any(w in message for w in ("claim", "Claim", "UID", "namespace", "name")), message


def _random_text(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return ""
    if kind == 1:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
    if kind == 2:
        return "../" * rng.randint(1, 8) + "etc/" + rng.choice(("passwd", "cdi", "x"))
    if kind == 3:
        return "x" * rng.choice((254, 1000, 20000))
    if kind == 4:
        return "a\x00b" + rng.choice(("", "/", "%2F..%2F"))
    return "".join(rng.choice(string.ascii_lowercase + "-.") for _ in range(rng.randint(1, 80)))


def test_fuzzed_grpc_requests(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    rng = random.Random(5322)
    api = api_for(cluster)
    ensure_namespace(api, NS)
    good = allocated_claim(api, node.name, NS, "fuzz-good", "gpu-6")
    canary = root / "canary.json"
    canary.write_text("{}")
    inst = start_instance(cluster, node, root / "p")
    fuzzed = Counter[str]()
    try:
        target = stub(inst.kubelet.plugin(DRIVER))
        channel = inst.kubelet.plugin(DRIVER).channel

        # Empty requests.
        assert dict(target.NodePrepareResources(prepare_request([]), timeout=10).claims) == {}
        assert dict(target.NodeUnprepareResources(unprepare_request([]), timeout=10).claims) == {}
        fuzzed["empty"] += 2

        # The same claim twice in one request: one answer, one journal entry.
        resp = target.NodePrepareResources(prepare_request([good, good]), timeout=30)
        assert list(resp.claims) == [good.uid] and resp.claims[good.uid].error == ""
        assert [d.device_name for d in resp.claims[good.uid].devices] == ["gpu-6"]
        assert_consistent(inst.plugin, {good.uid})
        resp = target.NodeUnprepareResources(unprepare_request([good, good]), timeout=30)
        assert list(resp.claims) == [good.uid] and resp.claims[good.uid].error == ""
        assert_consistent(inst.plugin, set())
        fuzzed["duplicate UIDs"] += 2

        # Unknown UIDs: an existing name with a wrong UID, and names that do not exist.
        wrong = ClaimRef(NS, "00000000-0000-0000-0000-000000000000", good.name)
        ghost = ClaimRef(NS, "11111111-2222-3333-4444-555555555555", "no-such-claim")
        resp = target.NodePrepareResources(prepare_request([wrong, ghost]), timeout=30)
        assert "does not match" in resp.claims[wrong.uid].error
        for result in resp.claims.values():
            _clear(result.error)
            assert result.error_type != api_pb2.Permanent
        resp = target.NodeUnprepareResources(unprepare_request([wrong, ghost]), timeout=30)
        assert all(r.error == "" for r in resp.claims.values())  # nothing to undo
        fuzzed["unknown UIDs"] += 4

        # A huge batch of claims that do not exist.
        huge = [ClaimRef(NS, f"uid-{i:05d}", f"missing-{i}") for i in range(1000)]
        resp = target.NodePrepareResources(prepare_request(huge), timeout=45)
        assert set(resp.claims) == {r.uid for r in huge}
        for result in resp.claims.values():
            _clear(result.error)
        resp = target.NodeUnprepareResources(unprepare_request(huge), timeout=45)
        assert all(r.error == "" for r in resp.claims.values())
        fuzzed["huge-batch requests (1000 claims each)"] += 2

        # Random strings as namespace, UID and name (traversal, NUL, huge, unicode).
        for _ in range(150):
            refs = [
                ClaimRef(_random_text(rng), _random_text(rng) or f"u{i}", _random_text(rng))
                for i in range(rng.randint(1, 5))
            ]
            op = rng.choice(("prepare", "unprepare"))
            try:
                if op == "prepare":
                    resp = target.NodePrepareResources(prepare_request(refs), timeout=30)
                    for result in resp.claims.values():
                        _clear(result.error)
                else:
                    resp = target.NodeUnprepareResources(unprepare_request(refs), timeout=30)
                    for result in resp.claims.values():
                        assert "Traceback" not in result.error
                assert set(resp.claims) == {r.uid for r in refs}
            except grpc.RpcError as err:
                # The only acceptable call-level failure: a clear status, not a crash.
                assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,), err
                assert err.details(), err
            fuzzed["random-string requests"] += 1

        # Random bytes as the whole message, and invalid UTF-8 inside a claim name.
        for method in (PREPARE, UNPREPARE):
            raw = channel.unary_unary(
                method, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            for _ in range(60):
                blob = rng.randbytes(rng.randint(1, 512))
                if rng.random() < 0.3:  # a well-formed Claim with a broken UTF-8 name
                    name = b"\xff\xfe" + rng.randbytes(8)
                    claim = b"\x0a\x02ns\x12\x03uid\x1a" + bytes([len(name)]) + name
                    blob = b"\x0a" + bytes([len(claim)]) + claim
                try:
                    raw(blob, timeout=10)
                except grpc.RpcError as err:
                    assert err.code() in (
                        grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.UNKNOWN,
                    ), err
                    assert err.details(), err
                fuzzed["random-byte messages"] += 1

        inst.plugin.check_alive()
        assert canary.read_text() == "{}"
        assert not list(root.glob("*.json.tmp*")) and sorted(p.name for p in root.iterdir()) == [
            "canary.json",
            "p",
        ]
        assert_consistent(inst.plugin, set())
        # Still fully functional.
        resp = target.NodePrepareResources(prepare_request([good]), timeout=30)
        assert resp.claims[good.uid].error == ""
        target.NodeUnprepareResources(unprepare_request([good]), timeout=30)
        assert_consistent(inst.plugin, set())
    finally:
        inst.stop()
        for key, n in fuzzed.items():
            figures[f"fuzz: {key}"] += n
        figures["fuzz: requests fuzzed (total)"] += sum(fuzzed.values())
