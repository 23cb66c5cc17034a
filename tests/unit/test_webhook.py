"""gpu-dra-webhook over real HTTPS with a self-signed certificate made by openssl."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from driver.config import API_VERSION, KIND
from driver.webhook import main as webhook_main
from driver.webhook.admission import review
from driver.webhook.server import VALIDATE_PATH, WebhookServer

DRIVER = "gpu.example.com"


@dataclass
class Served:
    server: WebhookServer
    cafile: str

    def connection(self) -> http.client.HTTPSConnection:
        context = ssl.create_default_context(cafile=self.cafile)
        return http.client.HTTPSConnection(
            "127.0.0.1", self.server.port, context=context, timeout=10
        )

    def post(self, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        conn = self.connection()
        try:
            conn.request("POST", VALIDATE_PATH, body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def admit(self, review_body: dict[str, Any]) -> dict[str, Any]:
        status, data = self.post(json.dumps(review_body).encode())
        assert status == 200, data
        answer: dict[str, Any] = json.loads(data)
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == review_body["request"]["uid"]
        response: dict[str, Any] = answer["response"]
        return response


def make_cert(directory: Path) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to create the test certificate"
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cert, key = make_cert(tmp_path_factory.mktemp("tls"))
    server = WebhookServer("127.0.0.1", 0, cert_file=cert, key_file=key, driver_name=DRIVER)
    server.start()
    try:
        yield Served(server, cert)
    finally:
        server.shutdown()


def params(sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "sharing": sharing}


GOOD = params({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
BAD_COUNT = params(
    {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 0}}
)
BAD_INTERVAL = params({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Sometimes"}})


def config(parameters: Any, driver: str = DRIVER) -> dict[str, Any]:
    return {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}


def claim(configs: list[Any], version: str = "v1") -> dict[str, Any]:
    request: dict[str, Any] = {"name": "gpu"}
    if version == "v1beta1":
        request["deviceClassName"] = "gpu.example.com"  # no `exactly` wrapper in v1beta1
    else:
        request["exactly"] = {"deviceClassName": "gpu.example.com"}
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": [request], "config": configs}},
    }


def template(configs: list[Any], version: str = "v1") -> dict[str, Any]:
    inner = claim(configs, version)
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {"spec": inner["spec"]},
    }


def admission(
    obj: Any,
    resource: str,
    version: str = "v1",
    *,
    uid: str = "uid-1",
    operation: str = "CREATE",
    old: Any = None,
    sub: str = "",
) -> dict[str, Any]:
    request: dict[str, Any] = {
        "uid": uid,
        "kind": {"group": "resource.k8s.io", "version": version, "kind": "X"},
        "resource": {"group": "resource.k8s.io", "version": version, "resource": resource},
        "operation": operation,
        "namespace": "ns",
        "object": obj,
    }
    if old is not None:
        request["oldObject"] = old
    if sub:
        request["subResource"] = sub
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@pytest.mark.parametrize("version", ["v1", "v1beta1", "v1beta2"])
def test_valid_claim_and_template_allowed(served: Served, version: str) -> None:
    configs = [config(GOOD), config({"x": "y"}, driver="other.example.com"), {"requests": []}]
    assert served.admit(admission(claim(configs, version), "resourceclaims", version)) == {
        "uid": "uid-1",
        "allowed": True,
    }
    response = served.admit(
        admission(template(configs, version), "resourceclaimtemplates", version, uid="uid-2")
    )
    assert response == {"uid": "uid-2", "allowed": True}


def test_defaults_are_applied_before_validation(served: Served) -> None:
    obj = claim(
        [
            config({"apiVersion": API_VERSION, "kind": KIND}),
            config(params({"strategy": "SpacePartitioning"})),
        ]
    )
    assert served.admit(admission(obj, "resourceclaims"))["allowed"] is True


@pytest.mark.parametrize("version", ["v1", "v1beta1", "v1beta2"])
def test_invalid_claim_denied_naming_fields(served: Served, version: str) -> None:
    obj = claim([config(GOOD), config(BAD_INTERVAL), config(BAD_COUNT)], version)
    response = served.admit(admission(obj, "resourceclaims", version))
    assert response["allowed"] is False
    assert response["status"]["reason"] == "Invalid"
    assert response["status"]["code"] == 422
    message = response["status"]["message"]
    assert message.startswith("2 configs failed to validate: ")
    assert (
        "spec.devices.config[1].opaque.parameters.sharing.timeSlicingConfig.interval: "
        "unknown time-slice interval: 'Sometimes'"
    ) in message
    assert (
        "spec.devices.config[2].opaque.parameters.sharing.spacePartitioningConfig"
        ".partitionCount: must be >= 1, got 0"
    ) in message


def test_invalid_template_denied_naming_fields(served: Served) -> None:
    obj = template([config(params({"strategy": "TimeSlicing", "extra": 1}))], "v1beta2")
    response = served.admit(admission(obj, "resourceclaimtemplates", "v1beta2"))
    assert response["allowed"] is False
    assert response["status"]["message"] == (
        "1 config failed to validate: "
        "spec.spec.devices.config[0].opaque.parameters.sharing.extra: unknown field"
    )


def test_duplicate_field_in_raw_body_denied(served: Served) -> None:
    body = json.dumps(admission(claim([config(GOOD)]), "resourceclaims"))
    body = body.replace('"interval": "Long"', '"interval": "Long", "interval": "Short"')
    status, data = served.post(body.encode())
    assert status == 200
    response = json.loads(data)["response"]
    assert response["allowed"] is False
    assert (
        "spec.devices.config[0].opaque.parameters.sharing.timeSlicingConfig.interval: "
        "duplicate field"
    ) in response["status"]["message"]


def test_unbounded_partition_count_denied(served: Served) -> None:
    huge = params({"strategy": "SpacePartitioning", "spacePartitioningConfig": {}})
    body = json.dumps(admission(claim([config(huge)]), "resourceclaims"))
    body = body.replace(
        '"spacePartitioningConfig": {}',
        '"spacePartitioningConfig": {"partitionCount": 1' + "0" * 30 + "}",
    )
    status, data = served.post(body.encode())
    assert status == 200
    response = json.loads(data)["response"]
    assert response["allowed"] is False
    assert response["status"]["message"] == (
        "1 config failed to validate: spec.devices.config[0].opaque.parameters.sharing"
        ".spacePartitioningConfig.partitionCount: must be <= 64, got a number of 100 bits"
    )


def test_unsupported_resource_denied_as_bad_request(served: Served) -> None:
    response = served.admit(admission(claim([]), "deviceclasses"))
    assert response["allowed"] is False
    assert response["status"]["reason"] == "BadRequest"
    assert "got {resource.k8s.io v1 deviceclasses}" in response["status"]["message"]
    response = served.admit(admission(claim([]), "resourceclaims", "v1alpha3"))
    assert response["allowed"] is False


def test_delete_status_and_unchanged_update_allowed(served: Served) -> None:
    bad = claim([config(BAD_COUNT)])
    assert served.admit(admission(None, "resourceclaims", operation="DELETE"))["allowed"]
    assert served.admit(admission(bad, "resourceclaims", operation="UPDATE", sub="status"))[
        "allowed"
    ]
    # finalizer removal on a claim admitted before the webhook existed must not be blocked
    assert served.admit(admission(bad, "resourceclaims", operation="UPDATE", old=bad))["allowed"]
    changed = served.admit(
        admission(bad, "resourceclaims", operation="UPDATE", old=claim([config(GOOD)]))
    )
    assert changed["allowed"] is False


def test_bad_requests(served: Served) -> None:
    status, data = served.post(b"{}", content_type="text/plain")
    assert status == 415
    assert data == b"contentType=text/plain, expected application/json"
    status, data = served.post(b"{not json")
    assert status == 400
    assert data.startswith(b"failed to read AdmissionReview from request body: invalid JSON")
    status, data = served.post(
        json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}).encode()
    )
    assert status == 400
    conn = served.connection()
    conn.request("POST", "/elsewhere", body=b"{}", headers={"Content-Type": "application/json"})
    assert conn.getresponse().status == 404
    conn.close()


def test_readyz_and_keep_alive(served: Served) -> None:
    conn = served.connection()
    try:
        for _ in range(2):  # the same connection serves several requests
            conn.request("GET", "/readyz")
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, b"ok")
        conn.request("GET", "/nothing")
        response = conn.getresponse()
        assert response.status == 404
        response.read()
    finally:
        conn.close()


def test_plain_http_is_refused(served: Served) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=10)
    with pytest.raises((http.client.HTTPException, OSError)):
        conn.request("GET", "/readyz")
        conn.getresponse()
    conn.close()
    # an idle client that never starts a handshake does not block others
    idle = socket.create_connection(("127.0.0.1", served.server.port))
    try:
        conn2 = served.connection()
        conn2.request("GET", "/readyz")
        assert conn2.getresponse().status == 200
        conn2.close()
    finally:
        idle.close()


def test_certificate_reload(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    server = WebhookServer("127.0.0.1", 0, cert_file=cert, key_file=key, driver_name=DRIVER)
    try:
        first = server.tls.context()
        assert server.tls.context() is first
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        new_cert, new_key = make_cert(fresh)
        shutil.copy(new_key, key)
        shutil.copy(new_cert, cert)
        assert server.tls.context() is not first
        Path(key).write_text("garbage")  # a half-written rotation keeps the last good context
        second = server.tls.context()
        assert server.tls.context() is second
    finally:
        server.server_close()


def test_review_never_crashes_on_odd_objects() -> None:
    odd: list[Any] = [
        None,
        [],
        "x",
        {"spec": None},
        {"spec": {"devices": []}},
        {"spec": {"devices": {"config": {}}}},
        {"spec": {"devices": {"config": [None, 1, {"opaque": 5}, {"opaque": {"driver": DRIVER}}]}}},
    ]
    for obj in odd:
        for resource in ("resourceclaims", "resourceclaimtemplates"):
            answer = review(admission(obj, resource), DRIVER)
            assert isinstance(answer["response"]["allowed"], bool)


def test_main_refuses_missing_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = webhook_main.main(
        [
            "--tls-cert-file",
            str(tmp_path / "none.crt"),
            "--tls-private-key-file",
            str(tmp_path / "none.key"),
            "--port",
            "0",
            "--bind-address",
            "127.0.0.1",
        ]
    )
    assert code == 1
    assert "cannot start" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        webhook_main.main(["--port", "0"])  # TLS files are required: no plain-HTTP mode
