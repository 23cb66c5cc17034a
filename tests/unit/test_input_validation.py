"""Bad input end to end: claim references at the gRPC boundary, names in API URLs,
duplicate keys in claims read at prepare, unbounded partition counts, the checkpoint
gauge and /healthz text, and symlinks at state file paths."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from driver.config import loads_json
from driver.devices.device_types import PublishedDevice
from driver.errors import DriverError, ErrorClass
from driver.health.store import HealthStore
from driver.kube.api import KubeApi, segment
from driver.kube.claims import ApiClaimReader, ClaimFailureReporter
from driver.observability import metrics
from driver.plugin.dra import add_dra_services
from driver.plugin.plugin_status import export_checkpoint_state, health_report
from driver.proto.dra.v1 import api_pb2 as v1
from driver.proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver.state.prepare import DeviceState
from driver.state.recovery.quarantine import quarantine_checkpoint
from driver.state.request import ClaimRef
from driver.webhook.admission import review

DRIVER = "gpu.example.com"
NODE = "node-a"
UID = "6f1c2a9e-3b4d-4e5f-8a6b-7c8d9e0f1a2b"

DEVICES = {
    "gpu-0": PublishedDevice("gpu-0", {"name": "gpu-0"}, "GPU-aaaa", 0, False, 7),
    # Like the reference's example GPUs: no maxPartitions published.
    "gpu-1": PublishedDevice("gpu-1", {"name": "gpu-1"}, "GPU-bbbb", 1, False, None),
}


# -- test doubles ----------------------------------------------------------------------


@dataclass
class FakeResponse:
    status: int
    data: bytes
    reason: str = "OK"

    def read(self) -> bytes:
        return self.data


class FakeApi(KubeApi):
    """KubeApi with the transport replaced: answers GETs of claims from raw JSON text
    (so duplicate keys reach the decoder as the API server would send them) and
    records every request."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.bodies: dict[str, bytes] = {}
        self.sent: list[tuple[str, str, object]] = []

    def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, str | int] | None,
        body: object,
        content_type: str | None,
        timeout: float,
        *,
        stream: bool,
    ) -> Any:
        self.sent.append((method, path, body))
        if method != "GET":
            return FakeResponse(201, b"{}")
        if path not in self.bodies:
            return FakeResponse(404, b'{"message": "not found"}', "Not Found")
        return FakeResponse(200, self.bodies[path])


@dataclass
class FakeHealth:
    def failure(self, device_name: str) -> str | None:
        return None

    def ensure_tainted(self, device_name: str) -> None:
        pass


@dataclass
class FakeReporter:
    reports: list[tuple[str, DriverError]] = field(default_factory=list)

    def permanent_failure(self, claim: dict[str, Any], error: DriverError) -> None:
        self.reports.append((claim["metadata"]["uid"], error))


def new_state(tmp_path: Path, api: FakeApi) -> DeviceState:
    return DeviceState(
        driver_name=DRIVER,
        node_name=NODE,
        devices=DEVICES,
        cdi_root=tmp_path / "cdi",
        data_dir=tmp_path / "plugin",
        claims=ApiClaimReader(api),
        health=FakeHealth(),
        reporter=FakeReporter(),
        lock_timeout=2.0,
    )


def claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


def parameters(sharing: str) -> str:
    return (
        '{"apiVersion": "gpu.resource.example.com/v1alpha1", "kind": "GpuConfig", '
        f'"sharing": {sharing}}}'
    )


def claim_json(uid: str, name: str, device: str, params: str | None = None) -> str:
    """A ResourceClaim as the API server sends it; `params` is pasted in verbatim (the
    API server keeps opaque parameters as the bytes it was given)."""
    config = (
        ""
        if params is None
        else f'{{"source": "FromClaim", "requests": [], '
        f'"opaque": {{"driver": "{DRIVER}", "parameters": {params}}}}}'
    )
    spec_config = (
        "" if params is None else f'{{"opaque": {{"driver": "{DRIVER}", "parameters": {params}}}}}'
    )
    result = f'{{"request": "gpu", "driver": "{DRIVER}", "pool": "{NODE}", "device": "{device}"}}'
    node = (
        '{"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", '
        f'"operator": "In", "values": ["{NODE}"]}}]}}]}}'
    )
    return (
        '{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", '
        f'"metadata": {{"namespace": "default", "name": "{name}", "uid": "{uid}"}}, '
        '"spec": {"devices": {"requests": [{"name": "gpu", '
        '"exactly": {"deviceClassName": "gpu.example.com"}}], '
        f'"config": [{spec_config}]}}}}, '
        f'"status": {{"allocation": {{"devices": {{"results": [{result}], '
        f'"config": [{config}]}}, "nodeSelector": {node}}}}}}}'
    )


def add_claim(
    api: FakeApi, uid: str, name: str, device: str, params: str | None = None
) -> ClaimRef:
    api.bodies[claim_path("default", name)] = claim_json(uid, name, device, params).encode()
    return ClaimRef("default", name, uid)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[DeviceState, FakeApi, v1_grpc.DRAPluginStub]]:
    api = FakeApi()
    state = new_state(tmp_path, api)
    state.recover()  # writes the common spec, as the plugin does at start
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_dra_services(server, state)
    sock = tmp_path / "dra.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{sock}")
    yield state, api, v1_grpc.DRAPluginStub(channel)
    channel.close()
    server.stop(0).wait()


# -- 1. claim references at the gRPC boundary ------------------------------------------


@pytest.mark.parametrize("rpc", ["unprepare", "prepare"])
def test_uid_common_can_no_longer_touch_the_common_spec(
    served: tuple[DeviceState, FakeApi, v1_grpc.DRAPluginStub], rpc: str
) -> None:
    state, api, stub = served
    common = state.cdi.common_spec_path
    assert state.cdi.claim_spec_path("common") == common  # what made `common` dangerous
    before = common.read_bytes()
    bad = v1.Claim(namespace="default", uid="common", name="claim-a")
    with pytest.raises(grpc.RpcError) as err:
        if rpc == "unprepare":
            stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[bad]))
        else:
            stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[bad]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith('claims[0].uid: "common" is not a UID')
    assert common.read_bytes() == before
    assert api.sent == []  # not even the claim was read


def test_traversal_in_the_name_never_reaches_the_api(
    served: tuple[DeviceState, FakeApi, v1_grpc.DRAPluginStub],
) -> None:
    _, api, stub = served
    bad = v1.Claim(namespace="default", uid=UID, name="../../../api/v1/secrets")
    with pytest.raises(grpc.RpcError) as err:
        stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[bad]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(
        'claims[0].name: "../../../api/v1/secrets" is not a DNS-1123 subdomain'
    )
    assert api.sent == []


def test_valid_request_prepares_and_unprepares(
    served: tuple[DeviceState, FakeApi, v1_grpc.DRAPluginStub],
) -> None:
    state, api, stub = served
    ref = add_claim(api, UID, "claim-a", "gpu-0")
    claim = v1.Claim(namespace=ref.namespace, uid=ref.uid, name=ref.name)
    response = stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[claim]))
    entry = response.claims[UID]
    assert entry.error == "" and [d.device_name for d in entry.devices] == ["gpu-0"]
    assert state.cdi.claim_spec_exists(UID)
    response = stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[claim]))
    assert response.claims[UID].error == ""
    assert not state.cdi.claim_spec_exists(UID) and state.cdi.common_spec_path.exists()


# -- names in API URLs ---------------------------------------------------------------


def test_segment_quotes_everything_reserved() -> None:
    assert segment("claim-a.b") == "claim-a.b"
    assert segment("a/b") == "a%2Fb"
    assert segment("a%2Fb") == "a%252Fb"
    assert segment("a?b#c d") == "a%3Fb%23c%20d"
    for bad in ("", ".", ".."):
        with pytest.raises(ValueError):
            segment(bad)


def test_claim_reader_quotes_namespace_and_name() -> None:
    api = FakeApi()
    reader = ApiClaimReader(api)
    with pytest.raises(DriverError):
        reader.get("ns/x", "a/../b?watch=1")
    assert api.sent[-1][:2] == (
        "GET",
        "/apis/resource.k8s.io/v1/namespaces/ns%2Fx/resourceclaims/a%2F..%2Fb%3Fwatch%3D1",
    )
    with pytest.raises(DriverError) as err:
        reader.get("default", "..")
    assert not err.value.permanent and len(api.sent) == 1  # refused before any request


def test_failure_reporter_quotes_namespace_and_name() -> None:
    api = FakeApi()
    reporter = ClaimFailureReporter(api, driver=DRIVER, node_name=NODE, device_status=True)
    claim = json.loads(claim_json(UID, "claim-a", "gpu-0"))
    claim["metadata"].update(namespace="n/s", name="c/d")
    reporter.permanent_failure(claim, DriverError(ErrorClass.INVALID_CONFIG, "bad"))
    assert [(m, p) for m, p, _ in api.sent] == [
        ("POST", "/api/v1/namespaces/n%2Fs/events"),
        ("PATCH", "/apis/resource.k8s.io/v1/namespaces/n%2Fs/resourceclaims/c%2Fd/status"),
    ]


# -- 2. one strict decoder -------------------------------------------------------------

DUPLICATE = parameters(
    '{"strategy": "SpacePartitioning", "strategy": "TimeSlicing", '
    '"timeSlicingConfig": {"interval": "Long"}}'
)


def test_duplicate_key_in_opaque_parameters_fails_prepare_like_the_webhook(
    tmp_path: Path,
) -> None:
    api = FakeApi()
    state = new_state(tmp_path, api)
    ref = add_claim(api, UID, "claim-a", "gpu-0", DUPLICATE)
    result = state.prepare([ref])[UID]
    error = result.error
    assert error is not None and error.permanent
    assert error.error_class is ErrorClass.INVALID_CONFIG
    assert (
        "status.allocation.devices.config[0].opaque.parameters.sharing.strategy: duplicate field"
    ) in str(error)
    assert not state.cdi.claim_spec_exists(UID)

    # The webhook, given the same claim, names the same key.
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r-1",
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "object": "OBJECT",
        },
    }
    raw = json.dumps(body).replace('"OBJECT"', claim_json(UID, "claim-a", "gpu-0", DUPLICATE))
    answer = review(loads_json(raw), DRIVER)["response"]
    assert answer["allowed"] is False
    assert (
        "spec.devices.config[0].opaque.parameters.sharing.strategy: duplicate field"
        in answer["status"]["message"]
    )


def test_api_bodies_keep_duplicate_keys_detectable() -> None:
    api = FakeApi()
    api.bodies["/x"] = b'{"a": 1, "a": 2}'
    parsed = api.request("GET", "/x")
    assert parsed == {"a": 2} and getattr(parsed, "duplicates", None) == ["a"]


# -- 3. partitionCount is bounded ------------------------------------------------------


def test_huge_partition_count_never_reaches_the_env(tmp_path: Path) -> None:
    api = FakeApi()
    state = new_state(tmp_path, api)
    huge = parameters(
        '{"strategy": "SpacePartitioning", '
        '"spacePartitioningConfig": {"partitionCount": 1000000000000000000000000000000}}'
    )
    ref = add_claim(api, UID, "claim-b", "gpu-1", huge)  # gpu-1: no maxPartitions
    error = state.prepare([ref])[UID].error
    assert error is not None and error.permanent
    assert error.error_class is ErrorClass.INVALID_CONFIG
    assert (
        "status.allocation.devices.config[0].opaque.parameters.sharing"
        ".spacePartitioningConfig.partitionCount: must be <= 64"
    ) in str(error)
    assert not state.cdi.claim_spec_exists(UID)


# -- 5. checkpoint corruption: gauge and /healthz text ---------------------------------


def corrupt_gauge() -> float | None:
    value: float | None = metrics.REGISTRY.get_sample_value("gpu_dra_checkpoint_corrupt")
    return value


def test_health_report_text() -> None:
    assert health_report(registered=True, last_synced=1796889600.4, checkpoint_problem=None) == (
        True,
        "ok: registered, slices synced at 2026-12-10T08:00:00+00:00\n",
    )
    ok, text = health_report(
        registered=False, last_synced=0, checkpoint_problem="checkpoint /x is corrupt (y)"
    )
    # Still healthy: a liveness restart cannot repair the file (see driver.plugin.plugin_status).
    assert ok is True
    assert text == (
        "ok: not registered, slices not synced yet; "
        "CHECKPOINT CORRUPT, prepare refused: checkpoint /x is corrupt (y)\n"
    )


def test_checkpoint_corruption_is_a_gauge_and_in_the_health_text(tmp_path: Path) -> None:
    api = FakeApi()
    state = new_state(tmp_path, api)
    export_checkpoint_state(state)
    try:
        state.recover()
        assert corrupt_gauge() == 0.0
        state.checkpoint.path.write_text("garbage")  # corrupted behind the plugin's back
        ref = add_claim(api, UID, "claim-a", "gpu-0")
        error = state.prepare([ref])[UID].error
        assert error is not None and not error.permanent and "is corrupt" in str(error)
        assert corrupt_gauge() == 1.0
        ok, text = health_report(
            registered=True, last_synced=1, checkpoint_problem=state.checkpoint_problem
        )
        assert ok and "CHECKPOINT CORRUPT" in text and str(state.checkpoint.path) in text
        assert state.checkpoint.path.read_text() == "garbage"  # never discarded

        # The operator moves it aside; the next call reads a sound journal.
        assert quarantine_checkpoint(state.checkpoint.data_dir) is not None
        assert state.prepare([ref])[UID].error is None
        assert corrupt_gauge() == 0.0
        assert (
            "CORRUPT"
            not in health_report(
                registered=True, last_synced=1, checkpoint_problem=state.checkpoint_problem
            )[1]
        )
    finally:
        metrics.CHECKPOINT_CORRUPT.set_function(lambda: 0.0)


def test_symlinked_checkpoint_is_reported_corrupt_at_start(tmp_path: Path) -> None:
    api = FakeApi()
    state = new_state(tmp_path, api)
    export_checkpoint_state(state)
    try:
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text("{}")
        state.checkpoint.data_dir.mkdir(parents=True, exist_ok=True)
        state.checkpoint.path.symlink_to(elsewhere)
        report = state.recover()
        assert report.checkpoint_problem is not None
        assert "symbolic link" in report.checkpoint_problem
        assert "(ELOOP)" in report.checkpoint_problem
        assert corrupt_gauge() == 1.0
    finally:
        metrics.CHECKPOINT_CORRUPT.set_function(lambda: 0.0)


# -- 4. the health store never follows a symlink ---------------------------------------


def test_symlinked_health_store_is_corrupt_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    doc = {
        "version": 1,
        "gpus": {"GPU-aaaa": {"key": "gpu.example.com/xid", "value": "79", "reason": "Xid 79"}},
    }
    elsewhere.write_text(json.dumps(doc))
    path = tmp_path / "health.json"
    path.symlink_to(elsewhere)
    with caplog.at_level(logging.ERROR):
        store = HealthStore(path)
    assert store.failed_gpus() == {}  # the linked content was not read
    assert "symbolic link" in caplog.text and "(ELOOP)" in caplog.text
    # Corrupt: every device failed (fail closed), the link left for the operator...
    assert set(store.device_failures(DEVICES)) == set(DEVICES)
    assert path.is_symlink() and not list(tmp_path.glob("health.json.corrupt-*"))
    store.record_xid("GPU-bbbb", 79)  # ...never written through, its target untouched
    assert path.is_symlink() and json.loads(elsewhere.read_text()) == doc


def test_corrupt_health_store_is_in_the_health_text(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text("[]")
    store = HealthStore(path)
    ok, text = health_report(
        registered=True,
        last_synced=1,
        checkpoint_problem=None,
        health_store_problem=store.problem,
    )
    assert ok  # a restart cannot repair it either (driver.plugin.plugin_status)
    assert f"HEALTH STORE CORRUPT, every GPU failed: health store {path} is corrupt" in text
    assert metrics.REGISTRY.get_sample_value("gpu_dra_health_store_corrupt") == 1.0
    assert (
        "CORRUPT"
        not in health_report(
            registered=True, last_synced=1, checkpoint_problem=None, health_store_problem=None
        )[1]
    )


def test_fresh_uid_shape_matches_the_api_server() -> None:
    """The accepted form is what k8s.io/apimachinery/pkg/util/uuid.NewUUID() makes."""
    from driver.plugin.dra import claim_field_error

    for _ in range(100):
        assert claim_field_error("default", str(uuid.uuid4()), "claim") is None
    assert claim_field_error("default", str(uuid.uuid4()).upper(), "claim") is not None
