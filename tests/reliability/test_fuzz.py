"""Fuzzed gRPC requests against the plugin's DRA socket: empty, duplicate, unknown
UIDs, huge batches, random strings and random bytes. Every claim gets a clear error
(or success), malformed messages get a gRPC status, and the plugin never crashes nor
touches anything outside its directories.

Which call-level statuses are acceptable, and for what (anything else fails):

* INVALID_ARGUMENT: the plugin's answer to a request it cannot serve at all, one with
  a claim reference the kubelet could never send (namespace not a DNS-1123 label, name
  not a DNS-1123 subdomain, UID not a lowercase UUID, or a field left empty). Only for
  such a request, and the details must name that claim and one of its bad fields.
* INTERNAL with the details "Exception deserializing request!": grpcio's own answer
  when the request bytes do not parse as the method's message (grpc/_server.py,
  `_receive_message` aborts with StatusCode.internal before any servicer code runs).
  Only for bytes that really do not parse.
* Never UNKNOWN: that is grpcio's status for an exception raised inside a servicer
  ("Exception calling application: ..."), i.e. a crashing handler.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

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
# grpcio's details when a request does not deserialize (grpc/_server.py).
UNDECODABLE = "Exception deserializing request!"
REQUEST_TYPES: dict[str, Any] = {
    PREPARE: api_pb2.NodePrepareResourcesRequest,
    UNPREPARE: api_pb2.NodeUnprepareResourcesRequest,
}


def _clear(message: str) -> None:
    assert message.strip(), "an empty error message"
    assert "Traceback" not in message, message
    assert any(w in message for w in ("claim", "Claim", "UID", "namespace", "name")), message


# A claim reference the kubelet can send names Kubernetes object metadata: the
# namespace a DNS-1123 label, the name a DNS-1123 subdomain, the UID a lowercase UUID.
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_VALID = {
    "namespace": (63, re.compile(_LABEL)),
    "uid": (36, re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")),
    "name": (253, re.compile(rf"{_LABEL}(?:\.{_LABEL})*")),
}
_DETAILS = re.compile(r"claims\[(\d+)\]\.(namespace|uid|name): .+", re.DOTALL)


def _malformed(claims: Sequence[Any]) -> tuple[int, set[str]] | None:
    """The first claim the kubelet could never send and its bad fields; None if every
    claim is well-formed (then the request must be answered claim by claim)."""
    for i, claim in enumerate(claims):
        bad = {
            field
            for field, (limit, pattern) in _VALID.items()
            if not (
                len(getattr(claim, field)) <= limit and pattern.fullmatch(getattr(claim, field))
            )
        }
        if bad:
            return i, bad
    return None


def _brief(value: object) -> str:
    """A repr short enough for a failure message (fuzzed strings run to 20000 chars)."""
    text = repr(value)
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} chars)"


def _check_rpc_error(err: grpc.RpcError, malformed: tuple[int, set[str]] | None, what: str) -> None:
    """A call-level failure must be INVALID_ARGUMENT naming the first malformed claim
    and one of its bad fields (`claims[<i>].<field>: <why>`), for a malformed request."""
    code, details = err.code(), err.details() or ""
    assert malformed is not None, (
        f"{what}: a well-formed request failed with {code.name}: {details}"
    )
    index, fields = malformed
    match = _DETAILS.fullmatch(details)
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and match is not None
        and int(match[1]) == index
        and match[2] in fields
    ), (
        f"{what}: expected INVALID_ARGUMENT naming claims[{index}]."
        f"{'|'.join(sorted(fields))}, got {code.name}: {details}"
    )


def _random_refs(rng: random.Random) -> list[ClaimRef]:
    """1-5 claim references: in about a third of the requests every field is
    well-formed (random but valid values), otherwise each field is random text."""
    valid = rng.random() < 0.3
    refs = []
    for _ in range(rng.randint(1, 5)):
        uid = str(uuid.UUID(int=rng.getrandbits(128)))
        if valid:
            name = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 30)))
            refs.append(ClaimRef(NS, uid, f"{name}.fuzz"))
        else:
            ns, name = _random_text(rng), _random_text(rng)
            refs.append(ClaimRef(ns, uid if rng.random() < 0.5 else _random_text(rng), name))
    return refs


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
        huge = [ClaimRef(NS, str(uuid.UUID(int=i)), f"missing-{i}") for i in range(1000)]
        resp = target.NodePrepareResources(prepare_request(huge), timeout=45)
        assert set(resp.claims) == {r.uid for r in huge}
        for result in resp.claims.values():
            _clear(result.error)
        resp = target.NodeUnprepareResources(unprepare_request(huge), timeout=45)
        assert all(r.error == "" for r in resp.claims.values())
        fuzzed["huge-batch requests (1000 claims each)"] += 2

        # Random strings as namespace, UID and name (traversal, NUL, huge, unicode).
        answers = Counter[str]()
        for _ in range(150):
            refs = _random_refs(rng)
            op = rng.choice(("prepare", "unprepare"))
            expected = _malformed(refs)
            try:
                if op == "prepare":
                    resp = target.NodePrepareResources(prepare_request(refs), timeout=30)
                    for result in resp.claims.values():
                        _clear(result.error)
                else:
                    resp = target.NodeUnprepareResources(unprepare_request(refs), timeout=30)
                    for result in resp.claims.values():
                        assert "Traceback" not in result.error
            except grpc.RpcError as err:
                # The only acceptable call-level failure: INVALID_ARGUMENT naming the
                # malformed claim, for a request that has one; never UNKNOWN (a crash).
                _check_rpc_error(err, expected, f"{op} {_brief(refs)}")
                answers["refused"] += 1
            else:
                assert expected is None, f"{op} {_brief(refs)} was answered despite {expected}"
                assert set(resp.claims) == {r.uid for r in refs}
                answers["answered"] += 1
            fuzzed["random-string requests"] += 1
        assert set(answers) == {"refused", "answered"}, answers  # both really exercised

        # Random bytes as the whole message, invalid UTF-8 inside a claim name, and
        # parseable claims with fields left out.
        outcomes = Counter[str]()
        for method in (PREPARE, UNPREPARE):
            raw = channel.unary_unary(
                method, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            for _ in range(60):
                blob = rng.randbytes(rng.randint(1, 512))
                dice = rng.random()
                if dice < 0.3:  # a well-formed Claim with a broken UTF-8 name
                    name = b"\xff\xfe" + rng.randbytes(8)
                    claim = b"\x0a\x02ns\x12\x03uid\x1a" + bytes([len(name)]) + name
                    blob = b"\x0a" + bytes([len(claim)]) + claim
                elif dice < 0.5:  # a parseable Claim, some of its fields left out
                    uid = b"00000000-0000-4000-8000-0000000000aa"
                    fields = [(1, b"ns"), (2, uid), (3, b"no-such-claim")]
                    kept = rng.sample(fields, rng.randint(1, 3))
                    claim = b"".join(bytes([tag << 3 | 2, len(v)]) + v for tag, v in kept)
                    blob = b"\x0a" + bytes([len(claim)]) + claim
                # What the plugin's server will make of the bytes: the same protobuf
                # runtime parses them on both ends of the socket.
                try:
                    claims = REQUEST_TYPES[method].FromString(blob).claims
                except DecodeError:
                    decodes, expected = False, None
                else:
                    decodes, expected = True, _malformed(claims)
                try:
                    raw(blob, timeout=10)
                except grpc.RpcError as err:
                    if decodes:
                        _check_rpc_error(err, expected, f"{method} {_brief(blob)}")
                    else:
                        assert (err.code(), err.details()) == (
                            grpc.StatusCode.INTERNAL,
                            UNDECODABLE,
                        ), f"undecodable {_brief(blob)}: got {err.code().name}: {err.details()}"
                    outcomes["malformed" if decodes else "undecodable"] += 1
                else:
                    kind = "malformed" if decodes else "undecodable"
                    assert decodes and expected is None, (
                        f"{method} answered {_brief(blob)} ({kind})"
                    )
                    outcomes["answered"] += 1
                fuzzed["random-byte messages"] += 1
        # Each kind of answer was really exercised (the checks above are not vacuous).
        assert set(outcomes) == {"malformed", "undecodable", "answered"}, outcomes

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
