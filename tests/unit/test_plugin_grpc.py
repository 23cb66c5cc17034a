"""Registration and DRA services over real unix sockets, as the kubelet calls them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from driver.errors import DriverError, device_failed, invalid_config, transient
from driver.observability import metrics
from driver.plugin.dra import add_dra_services
from driver.plugin.transport.registration import DRA_SERVICES, HEALTH_SERVICES, RegistrationServicer
from driver.plugin.transport.sockets import SUN_PATH_MAX, socket_paths
from driver.proto.dra.v1 import api_pb2 as v1
from driver.proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver.proto.dra.v1beta1 import api_pb2 as v1beta1
from driver.proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from driver.proto.pluginregistration.v1 import api_pb2 as reg
from driver.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.state.journal.checkpoint import PreparedDevice
from driver.state.request import ClaimRef, PrepareResult


class FakeState:
    def __init__(self) -> None:
        self.outcomes: dict[str, DriverError | None] = {}
        self.calls: list[list[ClaimRef]] = []

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        self.calls.append(list(claims))
        results = {}
        for ref in claims:
            error = self.outcomes.get(ref.uid)
            if error is not None:
                results[ref.uid] = PrepareResult(error=error)
            else:
                device = PreparedDevice(
                    pool_name="node-a",
                    device_name="gpu-0",
                    request_names=("gpu",),
                    cdi_device_ids=(f"k8s.gpu.example.com/gpu={ref.uid}-gpu-0",),
                    share_id="share-1",
                )
                results[ref.uid] = PrepareResult(devices=(device,))
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
        return {ref.uid: self.outcomes.get(ref.uid) for ref in claims}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FakeState, grpc.Channel]]:
    state = FakeState()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_dra_services(server, state)
    sock = tmp_path / "dra.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{sock}")
    yield state, channel
    channel.close()
    server.stop(0).wait()


def uid(tag: str) -> str:
    """A claim UID in the API server's form, the same for the same tag."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, tag))


def claim(tag: str) -> v1.Claim:
    return v1.Claim(namespace="ns", uid=uid(tag), name=f"claim-{tag}")


def test_prepare_reports_devices_and_share_id_on_v1(served: tuple[FakeState, grpc.Channel]) -> None:
    _, channel = served
    response = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=[claim("a")])
    )
    entry = response.claims[uid("a")]
    assert entry.error == "" and entry.error_type == v1.Unknown
    (device,) = entry.devices
    assert (device.pool_name, device.device_name, list(device.request_names)) == (
        "node-a",
        "gpu-0",
        ["gpu"],
    )
    assert list(device.cdi_device_ids) == [f"k8s.gpu.example.com/gpu={uid('a')}-gpu-0"]
    assert device.HasField("share_id") and device.share_id == "share-1"


@pytest.mark.parametrize(
    ("error", "marker", "error_type"),
    [
        (
            invalid_config("partitionCount 9 > maxPartitions 7"),
            "permanent (invalid-config): ",
            v1.Permanent,
        ),
        (device_failed("gpu-3 has Xid 79"), "permanent (device-failed): ", v1.Permanent),
        (transient("API server unavailable"), "API server", v1.Unknown),
    ],
)
def test_prepare_errors_carry_marker_and_error_type(
    served: tuple[FakeState, grpc.Channel], error: DriverError, marker: str, error_type: int
) -> None:
    state, channel = served
    state.outcomes[uid("bad")] = error
    response = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=[claim("bad"), claim("good")])
    )
    bad, good = response.claims[uid("bad")], response.claims[uid("good")]
    assert bad.error.startswith(marker)
    assert bad.error_type == error_type
    assert not bad.devices
    assert good.error == "" and len(good.devices) == 1


def test_v1beta1_is_served_by_the_same_implementation(
    served: tuple[FakeState, grpc.Channel],
) -> None:
    state, channel = served
    state.outcomes[uid("bad")] = invalid_config("nope")
    response = v1beta1_grpc.DRAPluginStub(channel).NodePrepareResources(
        v1beta1.NodePrepareResourcesRequest(
            claims=[v1beta1.Claim(namespace="ns", uid=uid("bad"), name="c")]
        )
    )
    assert response.claims[uid("bad")].error_type == v1beta1.Permanent
    unprepared = v1beta1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
        v1beta1.NodeUnprepareResourcesRequest(
            claims=[v1beta1.Claim(namespace="ns", uid=uid("x"), name="c")]
        )
    )
    assert unprepared.claims[uid("x")].error == ""


def test_malformed_requests_are_rejected_with_the_field(
    served: tuple[FakeState, grpc.Channel],
) -> None:
    state, channel = served
    stub = v1_grpc.DRAPluginStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="ns", name="c")])
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "claims[0].uid" in (err.value.details() or "")
    assert state.calls == []


BAD_REFS = [
    # (namespace, uid, name), the error details
    (("ns", "common", "c"), 'claims[0].uid: "common" is not a UID'),
    (("ns", "../x", "c"), 'claims[0].uid: "../x" is not a UID'),
    (("ns", uid("a").upper(), "c"), "claims[0].uid: "),
    (("ns", uid("a") + "/..", "c"), "claims[0].uid: "),
    (("ns", " " + uid("a"), "c"), "claims[0].uid: "),
    (("ns", uid("a"), "../x"), 'claims[0].name: "../x" is not a DNS-1123 subdomain'),
    (("ns", uid("a"), "Claim"), 'claims[0].name: "Claim" is not a DNS-1123 subdomain'),
    (("ns", uid("a"), "a/b"), 'claims[0].name: "a/b" is not a DNS-1123 subdomain'),
    (("ns", uid("a"), "a%2Fb"), "claims[0].name: "),
    (("ns", uid("a"), "a\x00b"), 'claims[0].name: "a\\u0000b" is not'),
    (("ns", uid("a"), "x" * 254), "claims[0].name: " + '"' + "x" * 64 + '"... (254 characters)'),
    (("Default", uid("a"), "c"), 'claims[0].namespace: "Default" is not a DNS-1123 label'),
    (("a.b", uid("a"), "c"), 'claims[0].namespace: "a.b" is not a DNS-1123 label'),
    (("..", uid("a"), "c"), 'claims[0].namespace: ".." is not a DNS-1123 label'),
    (("n" * 64, uid("a"), "c"), "claims[0].namespace: "),
    (("ns", "", "c"), "claims[0].uid: required value"),
]


@pytest.mark.parametrize(("ref", "details"), BAD_REFS)
@pytest.mark.parametrize("method", ["NodePrepareResources", "NodeUnprepareResources"])
def test_bad_claim_references_are_invalid_argument_naming_the_field(
    served: tuple[FakeState, grpc.Channel], ref: tuple[str, str, str], details: str, method: str
) -> None:
    state, channel = served
    namespace, claim_uid, name = ref
    bad = v1.Claim(namespace=namespace, uid=claim_uid, name=name)
    request_type = (
        v1.NodePrepareResourcesRequest
        if method == "NodePrepareResources"
        else v1.NodeUnprepareResourcesRequest
    )
    with pytest.raises(grpc.RpcError) as err:
        getattr(v1_grpc.DRAPluginStub(channel), method)(request_type(claims=[bad, claim("ok")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(details), err.value.details()
    assert state.calls == []


def test_the_bad_claim_is_named_by_its_index(served: tuple[FakeState, grpc.Channel]) -> None:
    _, channel = served
    claims = [claim("a"), claim("b"), claim("c"), v1.Claim(namespace="ns", uid="common", name="c")]
    with pytest.raises(grpc.RpcError) as err:
        v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=claims)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith('claims[3].uid: "common" is not a UID')


def test_longest_valid_names_and_api_server_uids_are_accepted(
    served: tuple[FakeState, grpc.Channel],
) -> None:
    state, channel = served
    name = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters
    good = [
        v1.Claim(namespace="n" * 63, uid=str(uuid.uuid4()), name=name),
        v1.Claim(namespace="kube-system", uid="00000000-0000-0000-0000-000000000000", name="x"),
        v1.Claim(namespace="a1", uid=uid("z"), name="pod-0-gpu-x7k2p"),
    ]
    assert len(name) == 253
    response = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=good)
    )
    assert sorted(response.claims) == sorted(c.uid for c in good)
    assert all(r.error == "" for r in response.claims.values())
    assert [(r.namespace, r.uid, r.name) for r in state.calls[0]] == [
        (c.namespace, c.uid, c.name) for c in good
    ]


def test_duplicate_uids_get_one_answer_and_one_prepare(
    served: tuple[FakeState, grpc.Channel],
) -> None:
    state, channel = served
    response = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=[claim("a"), claim("a")])
    )
    assert list(response.claims) == [uid("a")]
    assert [r.uid for r in state.calls[0]] == [uid("a")]


def test_empty_request_gets_empty_answer(served: tuple[FakeState, grpc.Channel]) -> None:
    _, channel = served
    response = v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
        v1.NodeUnprepareResourcesRequest()
    )
    assert dict(response.claims) == {}


def test_an_empty_prepare_is_answered_without_a_log_line_or_a_latency_sample(
    served: tuple[FakeState, grpc.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    """The readiness probe's call (driver.plugin.readiness) every few seconds: neither
    the log nor gpu_dra_prepare_seconds may fill with it."""
    state, channel = served
    samples = metrics.REGISTRY.get_sample_value("gpu_dra_prepare_seconds_count")
    with caplog.at_level(logging.DEBUG):
        response = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
            v1.NodePrepareResourcesRequest()
        )
    assert dict(response.claims) == {}
    assert state.calls == []
    assert not [r for r in caplog.records if "NodePrepareResources" in r.getMessage()]
    assert metrics.REGISTRY.get_sample_value("gpu_dra_prepare_seconds_count") == samples


def test_registration_handshake(tmp_path: Path) -> None:
    servicer = RegistrationServicer(
        "gpu.example.com", "/plugins/dra.sock", DRA_SERVICES + HEALTH_SERVICES
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)
    sock = tmp_path / "reg.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        stub = reg_grpc.RegistrationStub(grpc.insecure_channel(f"unix://{sock}"))
        info = stub.GetInfo(reg.InfoRequest(), timeout=1)
        assert (info.type, info.name, info.endpoint) == (
            "DRAPlugin",
            "gpu.example.com",
            "/plugins/dra.sock",
        )
        assert list(info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert "v1alpha1.DRAResourceHealth" in info.supported_versions
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True))
        assert servicer.registered.is_set()
        with pytest.raises(grpc.RpcError) as err:
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=False, error="version skew")
            )
        assert "version skew" in (err.value.details() or "")
        assert not servicer.registered.is_set()
    finally:
        server.stop(0).wait()


def test_socket_names_without_and_with_pod_uid(tmp_path: Path) -> None:
    fixed = socket_paths("gpu.example.com", tmp_path / "reg", tmp_path / "plug", None)
    assert fixed.registration.name == "gpu.example.com-reg.sock"
    assert fixed.service.name == "dra.sock"
    uid = "0f6c2a4e-1b0e-4c55-9e57-6e1a1f0d2b7a"
    rolling = socket_paths(
        "gpu.example.com",
        Path("/var/lib/kubelet/plugins_registry"),
        Path("/var/lib/kubelet/plugins/gpu.example.com"),
        uid,
    )
    assert rolling.registration.name == f"gpu.example.com-{uid}-reg.sock"
    assert rolling.service.name == f"dra-{uid}.sock"


def test_long_paths_are_shortened_to_fit_sun_path() -> None:
    deep = Path("/var/lib/kubelet/" + "x" * 40)
    paths = socket_paths(
        "a-rather-long-driver-name.vendor.example.com",
        deep,
        deep,
        "0f6c2a4e-1b0e-4c55-9e57-6e1a1f0d2b7a",
    )
    assert len(str(paths.registration)) <= SUN_PATH_MAX
    assert len(str(paths.service)) <= SUN_PATH_MAX
    other = socket_paths(
        "a-rather-long-driver-name.vendor.example.com",
        deep,
        deep,
        "1f6c2a4e-1b0e-4c55-9e57-6e1a1f0d2b7a",
    )
    assert other.registration != paths.registration and other.service != paths.service


def test_fixed_names_that_do_not_fit_name_the_flag() -> None:
    deep = Path("/var/lib/kubelet/" + "x" * 100)
    with pytest.raises(ValueError, match="--kubelet-registrar-directory-path: socket path"):
        socket_paths("gpu.example.com", deep, Path("/p"), None)
