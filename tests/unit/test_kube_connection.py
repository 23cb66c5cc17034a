"""API server settings (driver/kube/connection.py) and the plugin's import footprint."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import urllib3
import yaml

from driver.kube.api import ApiError, KubeApi
from driver.kube.connection import (
    InsecureServerError,
    KubeconfigError,
    Pem,
    connect,
    in_cluster_settings,
    read_kubeconfig,
)
from tests.unit.test_webhook import make_cert

REPO = Path(__file__).resolve().parents[2]


def kubeconfig(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], context: str = "c"
) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": context,
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
            }
        )
    )
    return path


def test_kubeconfig_with_inline_certificates_and_a_token(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path,
        {
            "server": "https://10.0.0.1:6443",
            "certificate-authority-data": base64.b64encode(b"CA PEM").decode(),
            "tls-server-name": "kubernetes",
        },
        {
            "client-certificate-data": base64.b64encode(b"CERT PEM").decode(),
            "client-key-data": base64.b64encode(b"KEY PEM").decode(),
            "token": "secret",
        },
    )
    settings = read_kubeconfig(path)
    assert settings is not None
    assert settings.server == "https://10.0.0.1:6443"
    assert settings.ca == Pem(data=b"CA PEM")
    assert settings.client_cert == Pem(data=b"CERT PEM")
    assert settings.client_key == Pem(data=b"KEY PEM")
    assert (settings.token, settings.tls_server_name, settings.insecure) == (
        "secret",
        "kubernetes",
        False,
    )


def test_kubeconfig_file_references_are_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path,
        {"server": "https://api:6443", "certificate-authority": "pki/ca.crt"},
        {"client-certificate": "/abs/admin.crt", "client-key": "pki/admin.key", "tokenFile": "t"},
    )
    settings = read_kubeconfig(path)
    assert settings is not None
    assert settings.ca == Pem(path=tmp_path / "pki/ca.crt")
    assert settings.client_cert == Pem(path=Path("/abs/admin.crt"))
    assert settings.client_key == Pem(path=tmp_path / "pki/admin.key")
    assert settings.token_file == tmp_path / "t"


@pytest.mark.parametrize(
    ("cluster_extra", "user"),
    [
        ({}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x"}}),
        ({}, {"auth-provider": {"name": "oidc"}}),
        ({}, {"username": "admin", "password": "pw"}),
        ({"proxy-url": "http://proxy:3128"}, {"token": "t"}),
    ],
)
def test_other_auth_and_proxies_are_left_to_the_official_loader(
    tmp_path: Path, cluster_extra: dict[str, Any], user: dict[str, Any]
) -> None:
    path = kubeconfig(tmp_path, {"server": "https://api:6443", **cluster_extra}, user)
    assert read_kubeconfig(path) is None


@pytest.mark.parametrize(
    ("cluster", "context", "field"),
    [
        ({"server": "https://api:6443"}, "other", "contexts has no entry named 'other'"),
        ({"server": "api:6443"}, "c", "clusters[k].cluster.server must be an http(s) URL"),
        (
            {"server": "https://api:6443", "certificate-authority-data": "%%%"},
            "c",
            "clusters[k].cluster.certificate-authority-data",
        ),
    ],
)
def test_bad_kubeconfig_names_the_field(
    tmp_path: Path, cluster: dict[str, Any], context: str, field: str
) -> None:
    path = kubeconfig(tmp_path, cluster, {"token": "t"}, context=context)
    with pytest.raises(KubeconfigError, match=re.escape(field)):
        read_kubeconfig(path)


def test_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match="No such file"):
        read_kubeconfig(tmp_path / "absent")


def test_in_cluster_settings(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_text("CA")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    settings = in_cluster_settings(env, tmp_path)
    assert settings.server == "https://[fd00::1]:443"
    assert settings.token_file == tmp_path / "token"
    assert settings.ca == Pem(path=tmp_path / "ca.crt")
    with pytest.raises(KubeconfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_settings({}, tmp_path)
    (tmp_path / "token").unlink()
    with pytest.raises(KubeconfigError, match="token does not exist"):
        in_cluster_settings(env, tmp_path)


# -- against a local HTTP server -------------------------------------------------------


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str, str | None, bytes]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        if self.path.startswith("/missing"):
            payload, status = b'{"message": "not here"}', 404
        elif "watch=true" in self.path:
            events = [{"type": "ADDED", "object": {"n": i}} for i in range(3)]
            payload, status = b"".join(json.dumps(e).encode() + b"\n" for e in events), 200
        else:
            payload, status = b'{"ok": true}', 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


def plain_http(path: Path | str) -> KubeApi:
    """A client of the local http:// test server, which needs the explicit opt-in."""
    return KubeApi(connect(str(path), allow_insecure_http=True))


@pytest.fixture
def server() -> Iterator[str]:
    Recorder.seen = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_requests_carry_the_token_query_and_json_body(tmp_path: Path, server: str) -> None:
    api = plain_http(kubeconfig(tmp_path, {"server": server}, {"token": "t0"}))
    assert api.request("GET", "/apis/x", query={"fieldSelector": "a=b,c=d"}) == {"ok": True}
    api.request("PATCH", "/apis/x/y", body={"k": "v"}, content_type="application/merge-patch+json")
    with pytest.raises(ApiError, match=r"404 .*not here"):
        api.request("GET", "/missing")
    assert [kind for kind, _ in api.watch("/apis/x", query={})] == ["ADDED"] * 3
    assert api.get_text("/metrics") == '{"ok": true}'
    assert Recorder.seen[0] == ("GET", "/apis/x?fieldSelector=a%3Db%2Cc%3Dd", "Bearer t0", b"")
    assert Recorder.seen[1] == ("PATCH", "/apis/x/y", "Bearer t0", b'{"k": "v"}')
    assert Recorder.seen[3][1] == "/apis/x?watch=true&timeoutSeconds=300"
    assert api.writes == 1


@pytest.mark.parametrize(
    ("user", "sent"),
    [
        ({"tokenFile": "token-file"}, "Bearer from-file"),
        ({"tokenFile": "token-file", "token": "inline"}, "Bearer inline"),  # as kubectl
        ({}, None),
    ],
)
def test_bearer_token_sources(
    tmp_path: Path, server: str, user: dict[str, Any], sent: str | None
) -> None:
    (tmp_path / "token-file").write_text("from-file\n")
    plain_http(kubeconfig(tmp_path, {"server": server}, user)).request("GET", "/apis/x")
    assert Recorder.seen == [("GET", "/apis/x", sent, b"")]


def test_exec_credentials_go_through_the_official_loader(tmp_path: Path, server: str) -> None:
    plugin = tmp_path / "credential"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": "from-exec"},
    }
    plugin.write_text(f"#!/bin/sh\necho '{json.dumps(credential)}'\n")
    plugin.chmod(0o755)
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin)}}
    path = kubeconfig(tmp_path, {"server": server}, user)
    plain_http(path).request("GET", "/apis/x")
    assert Recorder.seen == [("GET", "/apis/x", "Bearer from-exec", b"")]
    with pytest.raises(InsecureServerError, match=f"refusing to send credentials to {server} "):
        connect(str(path))  # the exec plugin's token would cross the network in clear


def test_a_kubeconfig_list_is_merged_by_the_official_loader(tmp_path: Path, server: str) -> None:
    first = kubeconfig(tmp_path, {"server": server}, {"token": "merged"})
    second = tmp_path / "second"
    second.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "users": []}))
    plain_http(f"{first}{os.pathsep}{second}").request("GET", "/apis/x")
    assert Recorder.seen == [("GET", "/apis/x", "Bearer merged", b"")]


def test_the_plugin_does_not_import_the_official_client() -> None:
    """The official client's package (and requests, oauthlib, websocket) cost most of
    the plugin's start-up and a third of its memory; the plugin reads its kubeconfig
    itself (the official loader is imported only for exec plugins and the like)."""
    heavy = ("kubernetes", "requests", "oauthlib", "websocket", "dateutil")
    code = (
        "import sys, driver.plugin.main; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "[]"


def test_https_trusts_the_kubeconfig_ca_only(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Recorder.seen = []
    server = f"https://127.0.0.1:{httpd.server_address[1]}"
    pem = Path(cert).read_bytes()
    user = {
        "client-certificate-data": base64.b64encode(pem).decode(),
        "client-key-data": base64.b64encode(Path(key).read_bytes()).decode(),
        "token": "t1",
    }
    try:
        with_ca = kubeconfig(
            tmp_path,
            {"server": server, "certificate-authority-data": base64.b64encode(pem).decode()},
            user,
        )
        connection = connect(str(with_ca))
        trusted = connection.pool.connection_pool_kw["ssl_context"].cert_store_stats()
        assert trusted["x509_ca"] == 1  # the cluster's CA, no public ones
        assert KubeApi(connection).request("GET", "/apis/x") == {"ok": True}
        assert Recorder.seen == [("GET", "/apis/x", "Bearer t1", b"")]

        without_ca = kubeconfig(tmp_path, {"server": server}, user)
        with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
            KubeApi.from_kubeconfig(str(without_ca)).request("GET", "/apis/x")
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("user", [{"token": "secret"}, {"tokenFile": "token-file"}])
def test_no_token_goes_to_a_plain_http_server(
    tmp_path: Path, server: str, user: dict[str, Any]
) -> None:
    (tmp_path / "token-file").write_text("secret\n")
    path = kubeconfig(tmp_path, {"server": server}, user)
    with pytest.raises(InsecureServerError) as refused:
        KubeApi.from_kubeconfig(str(path))  # what the plugin does
    message = str(refused.value)
    assert message.count("\n") == 0 and server in message and str(path) in message
    assert isinstance(refused.value, KubeconfigError)  # the plugin's one-line config error
    assert Recorder.seen == []  # nothing was sent


def test_plain_http_without_a_token_is_not_refused(tmp_path: Path, server: str) -> None:
    KubeApi(connect(str(kubeconfig(tmp_path, {"server": server}, {})))).request("GET", "/apis/x")
    assert Recorder.seen == [("GET", "/apis/x", None, b"")]


def test_gpu_dra_health_refuses_plain_http_unless_allowed(
    tmp_path: Path, server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from driver.cli import main

    path = kubeconfig(tmp_path, {"server": server}, {"token": "secret"})
    state = ["--state-dir", str(tmp_path), "--node-name", "n1", "-o", "json"]
    assert main(["health", *state, "--kubeconfig", str(path)]) == 0
    problem = json.loads(capsys.readouterr().out)["slices"]["problem"]
    assert f"refusing to send credentials to {server} over plain http" in problem
    assert problem.endswith("or pass --allow-insecure-http") and "\n" not in problem
    assert Recorder.seen == []

    assert main(["health", *state, "--kubeconfig", str(path), "--allow-insecure-http"]) == 0
    assert json.loads(capsys.readouterr().out)["slices"]["problem"] is None
    assert Recorder.seen[0][2] == "Bearer secret"
