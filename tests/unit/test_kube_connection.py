"""API server settings and credentials (driver/kube/kubeconfig.py, connection.py), requests through
KubeApi, and the plugin's import footprint."""

from __future__ import annotations

import base64
import datetime as dt
import http.server
import json
import os
import re
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import urllib3
import yaml

from driver.kube import connection
from driver.kube.api import ApiError, KubeApi
from driver.kube.connection import connect
from driver.kube.kubeconfig import (
    ExecPlugin,
    InsecureServerError,
    KubeconfigError,
    Pem,
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


def test_exec_and_proxy_settings_are_read(tmp_path: Path) -> None:
    exec_section = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "bin/credential",  # relative to the kubeconfig, as in kubectl
        "args": ["--region", "x"],
        "env": [{"name": "PROFILE", "value": "dev"}],
        "interactiveMode": "Never",
    }
    path = kubeconfig(
        tmp_path,
        {"server": "https://api:6443", "proxy-url": "http://proxy:3128"},
        {"exec": exec_section},
    )
    settings = read_kubeconfig(path)
    assert settings.proxy_url == "http://proxy:3128"
    assert settings.exec_plugin == ExecPlugin(
        where="users[u].user.exec",
        command=str(tmp_path / "bin/credential"),
        args=("--region", "x"),
        env=(("PROFILE", "dev"),),
        api_version="client.authentication.k8s.io/v1",
    )


@pytest.mark.parametrize(
    ("cluster_extra", "user", "field"),
    [
        ({}, {"auth-provider": {"name": "oidc"}}, "users[u].user.auth-provider: auth providers"),
        ({}, {"username": "admin", "password": "pw"}, "users[u].user.password: basic auth"),
        ({}, {"token": "t", "as": "someone"}, "users[u].user.as: impersonation"),
        ({"proxy-url": "socks5://proxy:1080"}, {}, "clusters[k].cluster.proxy-url must be"),
        ({"something-new": True}, {}, "clusters[k].cluster.something-new is not supported"),
        ({}, {"exec": {"command": "x"}}, "users[u].user.exec.apiVersion must be one of"),
        (
            {},
            {
                "exec": {
                    "apiVersion": "client.authentication.k8s.io/v1",
                    "command": "x",
                    "provideClusterInfo": True,
                }
            },
            "users[u].user.exec.provideClusterInfo is not supported",
        ),
    ],
)
def test_unsupported_settings_are_refused_by_name(
    tmp_path: Path, cluster_extra: dict[str, Any], user: dict[str, Any], field: str
) -> None:
    path = kubeconfig(tmp_path, {"server": "https://api:6443", **cluster_extra}, user)
    with pytest.raises(KubeconfigError, match=re.escape(field)) as refused:
        read_kubeconfig(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


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


CREDENTIAL_PLUGIN = """\
import json, os, sys
from pathlib import Path
runs = Path(os.environ["RUNS_FILE"])
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["kind"] == "ExecCredential" and info["spec"]["interactive"] is False, info
status = {"expirationTimestamp": os.environ["EXPIRES"]}
if os.environ.get("CERT"):
    status["clientCertificateData"] = Path(os.environ["CERT"]).read_text()
    status["clientKeyData"] = Path(os.environ["KEY"]).read_text()
else:
    status["token"] = f"{sys.argv[1]}-{len(runs.read_text())}"
print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": status}))
"""


def exec_user(tmp_path: Path, expires: dt.datetime, **env: str) -> dict[str, Any]:
    """A kubeconfig user whose exec plugin (bin/credential, relative to the kubeconfig
    as kubectl resolves it) answers `<its argument>-<how many times it ran>` as the
    token, or with CERT and KEY, that client certificate."""
    plugin = tmp_path / "bin" / "credential"
    plugin.parent.mkdir(exist_ok=True)
    plugin.write_text(f"#!{sys.executable}\n{CREDENTIAL_PLUGIN}")
    plugin.chmod(0o755)
    env = {"RUNS_FILE": str(tmp_path / "runs"), "EXPIRES": expires.isoformat(), **env}
    exec_section = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "bin/credential",
        "args": ["from-exec"],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "interactiveMode": "IfAvailable",
    }
    return {"exec": exec_section}


def runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text()) if (tmp_path / "runs").exists() else 0


def test_an_exec_token_is_kept_until_it_expires(tmp_path: Path, server: str) -> None:
    in_an_hour = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    path = kubeconfig(tmp_path, {"server": server}, exec_user(tmp_path, in_an_hour))
    api = plain_http(path)
    api.request("GET", "/apis/x")
    api.request("GET", "/apis/y")
    assert [auth for _, _, auth, _ in Recorder.seen] == ["Bearer from-exec-1"] * 2
    assert runs(tmp_path) == 1


def test_an_expired_exec_token_is_renewed(tmp_path: Path, server: str) -> None:
    expired = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    path = kubeconfig(tmp_path, {"server": server}, exec_user(tmp_path, expired))
    api = plain_http(path)  # runs the plugin once
    api.request("GET", "/apis/x")
    api.request("GET", "/apis/y")
    assert [auth for _, _, auth, _ in Recorder.seen] == ["Bearer from-exec-2", "Bearer from-exec-3"]


def test_an_exec_token_never_goes_to_a_plain_http_server(tmp_path: Path, server: str) -> None:
    in_an_hour = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    path = kubeconfig(tmp_path, {"server": server}, exec_user(tmp_path, in_an_hour))
    with pytest.raises(InsecureServerError, match=f"refusing to send credentials to {server} "):
        connect(str(path))
    assert runs(tmp_path) == 0 and Recorder.seen == []


def test_an_exec_client_certificate_is_presented(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    in_an_hour = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    with tls_server(cert, key, client_ca=cert) as server:
        ca = {"server": server, "certificate-authority-data": b64(Path(cert).read_bytes())}
        with_exec = kubeconfig(tmp_path, ca, exec_user(tmp_path, in_an_hour, CERT=cert, KEY=key))
        assert KubeApi.from_kubeconfig(str(with_exec)).request("GET", "/apis/x") == {"ok": True}
        without = kubeconfig(tmp_path, ca, {})
        with pytest.raises(urllib3.exceptions.MaxRetryError):  # the server asks for one
            KubeApi.from_kubeconfig(str(without)).request("GET", "/apis/x", timeout=5)
    assert runs(tmp_path) == 1


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("echo broken >&2; exit 3", "exited with 3: broken"),
        ("echo not json", "the plugin's output is not JSON"),
        ('echo \'{"kind": "ExecCredential"}\'', "answered apiVersion None"),
    ],
)
def test_a_failing_exec_plugin_is_a_config_error_naming_the_field(
    tmp_path: Path, server: str, script: str, message: str
) -> None:
    plugin = tmp_path / "bin" / "credential"
    plugin.parent.mkdir()
    plugin.write_text(f"#!/bin/sh\n{script}\n")
    plugin.chmod(0o755)
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "bin/credential"}}
    path = kubeconfig(tmp_path, {"server": server}, user)
    with pytest.raises(KubeconfigError, match=re.escape(message)) as failed:
        plain_http(path)
    assert "users[u].user.exec" in str(failed.value) and str(path) in str(failed.value)


def test_a_kubeconfig_list_is_merged_as_kubectl_merges_it(tmp_path: Path, server: str) -> None:
    """current-context and every entry from the first file that names them; a relative
    path from the directory of the file that named it; a missing file skipped."""
    first, second = tmp_path / "a" / "config", tmp_path / "b" / "config"
    first.parent.mkdir()
    second.parent.mkdir()
    (second.parent / "token").write_text("from-b\n")
    first.write_text(
        yaml.safe_dump(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": server}}],
            }
        )
    )
    second.write_text(
        yaml.safe_dump(
            {
                "current-context": "other",
                "clusters": [{"name": "k", "cluster": {"server": "https://not-this:6443"}}],
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
            }
        )
    )
    listed = os.pathsep.join([str(first), str(tmp_path / "absent"), str(second)])
    plain_http(listed).request("GET", "/apis/x")
    assert Recorder.seen == [("GET", "/apis/x", "Bearer from-b", b"")]
    with pytest.raises(KubeconfigError, match="none of its files exists"):
        read_kubeconfig(f"{tmp_path / 'absent'}{os.pathsep}{tmp_path / 'absent2'}")


def test_requests_go_through_the_kubeconfig_proxy(tmp_path: Path, server: str) -> None:
    target = "http://kube-api.invalid:6443"
    path = kubeconfig(tmp_path, {"server": target, "proxy-url": server}, {})
    KubeApi.from_kubeconfig(str(path)).request("GET", "/apis/x")
    assert Recorder.seen == [("GET", f"{target}/apis/x", None, b"")]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_the_in_cluster_token_is_re_read_as_it_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = make_cert(tmp_path)
    secrets = tmp_path / "serviceaccount"
    secrets.mkdir()
    (secrets / "ca.crt").write_bytes(Path(cert).read_bytes())
    (secrets / "token").write_text("first\n")
    clock = FakeClock()
    monkeypatch.setattr(connection, "IN_CLUSTER_DIR", secrets)
    monkeypatch.setattr(connection, "time", clock)
    with tls_server(cert, key) as server:
        host, port = server.removeprefix("https://").rsplit(":", 1)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        api = KubeApi.from_kubeconfig(None)
        api.request("GET", "/apis/x")
        (secrets / "token").write_text("rotated\n")
        clock.now += connection.TOKEN_REFRESH_SECONDS - 1
        api.request("GET", "/apis/x")
        clock.now += 1
        api.request("GET", "/apis/x")
    assert [auth for _, _, auth, _ in Recorder.seen] == [
        "Bearer first",
        "Bearer first",
        "Bearer rotated",
    ]


def test_the_plugin_does_not_import_the_official_client() -> None:
    """The official client's package (and requests, oauthlib, websocket) cost most of
    the plugin's start-up and a quarter of its memory; the plugin reads its kubeconfig
    itself (driver/kube/connection.py's docstring)."""
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


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@contextmanager
def tls_server(cert: str, key: str, client_ca: str | None = None) -> Iterator[str]:
    """A Recorder over TLS at https://127.0.0.1:<port>; with `client_ca`, it requires a
    client certificate that CA signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Recorder.seen = []
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_https_trusts_the_kubeconfig_ca_only(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    pem = Path(cert).read_bytes()
    user = {
        "client-certificate-data": b64(pem),
        "client-key-data": b64(Path(key).read_bytes()),
        "token": "t1",
    }
    with tls_server(cert, key) as server:
        with_ca = kubeconfig(
            tmp_path, {"server": server, "certificate-authority-data": b64(pem)}, user
        )
        api_connection = connect(str(with_ca))
        trusted = api_connection.pool.connection_pool_kw["ssl_context"].cert_store_stats()
        assert trusted["x509_ca"] == 1  # the cluster's CA, no public ones
        assert KubeApi(api_connection).request("GET", "/apis/x") == {"ok": True}
        assert Recorder.seen == [("GET", "/apis/x", "Bearer t1", b"")]

        without_ca = kubeconfig(tmp_path, {"server": server}, user)
        with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
            KubeApi.from_kubeconfig(str(without_ca)).request("GET", "/apis/x")


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
