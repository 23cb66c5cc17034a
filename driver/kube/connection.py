"""How to reach the API server and authenticate to it: the settings read by
driver/kube/kubeconfig.py turned into a urllib3 connection pool and an Authorization
header (a token, re-read as it rotates, or an exec plugin's credential, kept until its
`expirationTimestamp`). What is read and what is refused: docs/architecture.md, "The
Kubernetes client".

The official client (`kubernetes`) is not used. Measured side by side with a port of
KubeApi onto it (docs/benchmarks.md, "The Kubernetes client"), it cost the plugin 15 MiB
of RSS (a quarter more) and 0.1-0.15 s of start-up, for no gain in prepare latency:
importing any of it runs the whole package and pulls in requests, oauthlib,
websocket-client and dateutil.

A server given as `http://` gets no credentials: `connect` refuses a kubeconfig that
would send a bearer token (inline, from a file or from an exec plugin) over plain HTTP,
where anyone on the path reads it, unless the caller passes `allow_insecure_http`
(`gpu-dra health --allow-insecure-http`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import urllib3

from driver.kube.kubeconfig import (
    IN_CLUSTER_DIR,
    ConnectionSettings,
    ExecPlugin,
    InsecureServerError,
    KubeconfigError,
    Pem,
    in_cluster_settings,
    read_kubeconfig,
)

TOKEN_REFRESH_SECONDS = 60.0  # as the official client re-reads a rotated token
POOL_SIZE = 16  # the publisher writes in parallel; watches and prepares share the pool
EXEC_TIMEOUT_SECONDS = 60.0  # an exec credential plugin that hangs fails the request
EXEC_EXPIRY_MARGIN_SECONDS = 10.0  # renew a credential this long before it expires


class Connection:
    """A pool of HTTP(S) connections to one API server, plus how to authenticate."""

    def __init__(
        self, server: str, pool: urllib3.PoolManager, authorization: Callable[[], str | None]
    ) -> None:
        self.server = server.rstrip("/")
        self.pool = pool
        self.authorization = authorization

    def request(
        self,
        method: str,
        path_and_query: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout: float,
        stream: bool,
    ) -> urllib3.BaseHTTPResponse:
        sent = dict(headers)
        auth = self.authorization()
        if auth:
            sent["Authorization"] = auth
        return self.pool.request(
            method,
            self.server + path_and_query,
            body=body,
            headers=sent,
            timeout=urllib3.Timeout(total=timeout),
            preload_content=not stream,
        )


def connect(kubeconfig: str | None, *, allow_insecure_http: bool = False) -> Connection:
    """A connection from `kubeconfig` (a path, or several joined by `:` as in
    $KUBECONFIG), or the in-cluster settings if None. InsecureServerError where a token
    would go to an `http://` server, unless `allow_insecure_http`."""
    if not kubeconfig:
        settings = in_cluster_settings(os.environ, IN_CLUSTER_DIR)  # always https
        return Connection(settings.server, _pool(settings), _authorization(settings))
    settings = read_kubeconfig(kubeconfig)
    sends_token = bool(settings.token or settings.token_file or settings.exec_plugin)
    if settings.server.lower().startswith("http://") and sends_token and not allow_insecure_http:
        raise InsecureServerError(kubeconfig, settings.server)
    if settings.exec_plugin is None or settings.token or settings.token_file:
        # A token wins over an exec plugin, as in kubectl and the official client.
        return Connection(settings.server, _pool(settings), _authorization(settings))
    # The plugin runs now (its client certificate, if it gives one, is in the pool's TLS
    # context); a renewed certificate gets a new pool, as kept-alive connections hold
    # the old one.
    credentials = ExecCredentials(settings.exec_plugin, kubeconfig)
    loaded = credentials.current()

    def pool() -> urllib3.PoolManager:
        if loaded.client_cert is None:
            return _pool(settings)
        return _pool(
            replace(settings, client_cert=loaded.client_cert, client_key=loaded.client_key)
        )

    def authorization() -> str | None:
        nonlocal loaded
        credential = credentials.current()
        if credential is not loaded:
            loaded = credential
            if credential.client_cert is not None:
                stale, connection.pool = connection.pool, pool()
                stale.clear()
        return credential.authorization

    connection = Connection(settings.server, pool(), authorization)
    return connection


@dataclass(frozen=True)
class ExecCredential:
    """An ExecCredential's status: a bearer token or a client certificate and key."""

    authorization: str | None = None  # "Bearer <token>"
    client_cert: Pem | None = None
    client_key: Pem | None = None
    expires_at: float | None = None  # time.time(); None: never


class ExecCredentials:
    """An exec credential plugin's answer, run again once it has expired."""

    def __init__(self, plugin: ExecPlugin, kubeconfig: str) -> None:
        self._plugin = plugin
        self._kubeconfig = kubeconfig
        self._lock = threading.Lock()
        self._credential: ExecCredential | None = None

    def current(self) -> ExecCredential:
        with self._lock:
            credential = self._credential
            if credential is None or (
                credential.expires_at is not None
                and time.time() >= credential.expires_at - EXEC_EXPIRY_MARGIN_SECONDS
            ):
                credential = self._credential = self._run()
            return credential

    def _error(self, detail: str) -> KubeconfigError:
        return KubeconfigError(f"kubeconfig {self._kubeconfig}: {self._plugin.where}: {detail}")

    def _run(self) -> ExecCredential:
        plugin = self._plugin
        request = {
            "apiVersion": plugin.api_version,
            "kind": "ExecCredential",
            "spec": {"interactive": False},
        }
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": json.dumps(request)}
        try:
            done = subprocess.run(  # a bare command is looked up in env's PATH
                [plugin.command, *plugin.args],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=EXEC_TIMEOUT_SECONDS,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise self._error(f"running {plugin.command!r}: {err}") from err
        if done.returncode != 0:
            stderr = " ".join(done.stderr.decode(errors="replace").split())[:500]
            raise self._error(f"{plugin.command!r} exited with {done.returncode}: {stderr}")
        try:
            answer = json.loads(done.stdout)
        except ValueError as err:
            raise self._error(f"the plugin's output is not JSON: {err}") from err
        if not isinstance(answer, dict) or answer.get("kind") != "ExecCredential":
            raise self._error("the plugin's output is not an ExecCredential")
        if answer.get("apiVersion") != self._plugin.api_version:
            raise self._error(
                f"the plugin answered apiVersion {answer.get('apiVersion')!r}, "
                f"not {self._plugin.api_version!r}"
            )
        status = answer.get("status")
        if not isinstance(status, dict):
            raise self._error("the plugin's ExecCredential has no status")
        expires_at = None
        if status.get("expirationTimestamp"):
            try:
                expires_at = dt.datetime.fromisoformat(status["expirationTimestamp"]).timestamp()
            except (TypeError, ValueError) as err:
                raise self._error(f"status.expirationTimestamp: {err}") from err
        if status.get("token"):
            return ExecCredential(authorization=f"Bearer {status['token']}", expires_at=expires_at)
        cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
        if cert and key:
            return ExecCredential(
                client_cert=Pem(data=str(cert).encode()),
                client_key=Pem(data=str(key).encode()),
                expires_at=expires_at,
            )
        raise self._error(
            "the plugin's ExecCredential has neither status.token nor "
            "status.clientCertificateData and status.clientKeyData"
        )


def _pool(settings: ConnectionSettings) -> urllib3.PoolManager:
    extra: dict[str, Any] = {}
    if settings.server.startswith("https://"):
        extra["ssl_context"] = _tls_context(settings)
        if settings.tls_server_name:
            extra["server_hostname"] = settings.tls_server_name
    if settings.proxy_url:
        return urllib3.ProxyManager(settings.proxy_url, maxsize=POOL_SIZE, **extra)
    return urllib3.PoolManager(maxsize=POOL_SIZE, **extra)


def _tls_context(settings: ConnectionSettings) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and hostname
    if settings.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif settings.ca is not None:
        # The cluster's CA only, as the official client does: not the system's public
        # CAs too (whose loading was also 20-70 ms of the plugin's start).
        context.load_verify_locations(cadata=settings.ca.read().decode())
    else:
        context.load_default_certs()
    if settings.client_cert is not None:
        key = settings.client_key or settings.client_cert
        with _as_file(settings.client_cert) as cert_path, _as_file(key) as key_path:
            context.load_cert_chain(cert_path, key_path)
    return context


@contextmanager
def _as_file(pem: Pem) -> Iterator[str]:
    """A path `ssl` can load the PEM from: the file itself, or inline data in an
    anonymous memory file (a private key never touches the disk)."""
    if pem.path is not None:
        yield str(pem.path)
        return
    fd = os.memfd_create("kubeconfig-pem", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem.read())
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _authorization(settings: ConnectionSettings) -> Callable[[], str | None]:
    """`token` wins over `tokenFile`, as in kubectl and the official client."""
    if settings.token_file is not None and not settings.token:
        return _TokenFile(settings.token_file).header
    header = f"Bearer {settings.token}" if settings.token else None
    return lambda: header


class _TokenFile:
    """A bearer token read from a file that is rotated underneath (bound service
    account tokens): re-read at most once a minute."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._token = ""
        self._read_at = -TOKEN_REFRESH_SECONDS

    def header(self) -> str:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= TOKEN_REFRESH_SECONDS:
                self._token = self._path.read_text().strip()
                self._read_at = now
            return f"Bearer {self._token}"
