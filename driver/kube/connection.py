"""Where the API server is and how to authenticate to it: kubeconfig or in-cluster
settings, turned into a urllib3 connection pool and an Authorization header.

Importing the official client's loader (`kubernetes.config`) runs the whole
`kubernetes` package (dynamic client, watch, stream, informer, utils) and pulls in
requests, oauthlib, websocket and dateutil: about 230 modules and 20 MiB, most of the
plugin's start-up time and a third of its memory. The plugin needs none of them for
the usual cases, which are read here: the in-cluster service account (token re-read
as kubelet rotates it), and kubeconfig users with a client certificate and/or a
bearer token. Anything else in a kubeconfig (exec plugins, auth providers, basic
auth, impersonation, proxies) and lists of kubeconfig files to merge are handed to the
official loader, imported only then.

A server given as `http://` gets no credentials: `connect` refuses a kubeconfig that
would send a bearer token (inline, from a file, from an exec plugin or an auth
provider) over plain HTTP, where anyone on the path reads it, unless the caller
passes `allow_insecure_http` (`gpu-dra health --allow-insecure-http`).
"""

from __future__ import annotations

import base64
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REFRESH_SECONDS = 60.0  # as the official client re-reads a rotated token
POOL_SIZE = 16  # the publisher writes in parallel; watches and prepares share the pool

# Cluster and user fields read here; any other (non-empty) field needs the official loader.
_CLUSTER_FIELDS = frozenset(
    {
        "server",
        "certificate-authority",
        "certificate-authority-data",
        "insecure-skip-tls-verify",
        "tls-server-name",
        "extensions",
    }
)
_USER_FIELDS = frozenset(
    {
        "client-certificate",
        "client-certificate-data",
        "client-key",
        "client-key-data",
        "token",
        "tokenFile",
        "extensions",
    }
)


class KubeconfigError(ValueError):
    """A kubeconfig or in-cluster setting that cannot be used; names the field."""


class InsecureServerError(KubeconfigError):
    """Credentials would be sent to an `http://` server; names the server."""

    def __init__(self, kubeconfig: str, server: str) -> None:
        self.server = server
        super().__init__(
            f"kubeconfig {kubeconfig}: refusing to send credentials to {server} over plain "
            "http (anyone on the path could read them); use an https server"
        )


@dataclass(frozen=True)
class Pem:
    """PEM content, from a file or inline (`*-data`)."""

    path: Path | None = None
    data: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        return self.path.read_bytes()


@dataclass(frozen=True)
class ConnectionSettings:
    server: str
    ca: Pem | None = None
    client_cert: Pem | None = None
    client_key: Pem | None = None
    token: str | None = None
    token_file: Path | None = None
    insecure: bool = False
    tls_server_name: str | None = None


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
    $KUBECONFIG, which the official loader merges), or the in-cluster settings if None.
    InsecureServerError where a token would go to an `http://` server, unless
    `allow_insecure_http`."""
    if not kubeconfig:
        settings = in_cluster_settings(os.environ, IN_CLUSTER_DIR)  # always https
        return Connection(settings.server, _pool(settings), _authorization(settings))
    direct = None if os.pathsep in kubeconfig else read_kubeconfig(Path(kubeconfig))
    if direct is None:
        connection = _connect_with_official_loader(kubeconfig)
    else:
        connection = Connection(direct.server, _pool(direct), _authorization(direct))
    if connection.server.lower().startswith("http://") and not allow_insecure_http:
        if direct is not None:
            sends_token = bool(direct.token or direct.token_file)
        else:  # an exec plugin's, an auth provider's or a merged kubeconfig's token
            sends_token = connection.authorization() is not None
        if sends_token:
            raise InsecureServerError(kubeconfig, connection.server)
    return connection


def in_cluster_settings(env: Mapping[str, str], secrets_dir: Path) -> ConnectionSettings:
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    port = env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeconfigError(
            "in-cluster config: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be "
            "set (not running in a pod? give --kubeconfig)"
        )
    token_file = secrets_dir / "token"
    ca_file = secrets_dir / "ca.crt"
    for path in (token_file, ca_file):
        if not path.is_file():
            raise KubeconfigError(f"in-cluster config: {path} does not exist")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return ConnectionSettings(
        server=f"https://{host}:{port}", ca=Pem(path=ca_file), token_file=token_file
    )


def read_kubeconfig(path: Path) -> ConnectionSettings | None:
    """The current context's settings, or None where they need the official loader."""
    # Here only: an in-cluster plugin (no kubeconfig file) never loads PyYAML.
    import yaml

    try:
        doc = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as err:
        raise KubeconfigError(f"kubeconfig {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise KubeconfigError(f"kubeconfig {path}: not YAML: {err}") from err
    if not isinstance(doc, dict):
        raise KubeconfigError(f"kubeconfig {path}: not a mapping")
    context_name = doc.get("current-context")
    if not context_name:
        raise KubeconfigError(f"kubeconfig {path}: current-context is not set")
    context = _named(doc, "contexts", "context", context_name, path)
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"), path)
    user = _named(doc, "users", "user", context.get("user"), path) if context.get("user") else {}
    if set(k for k, v in cluster.items() if v) - _CLUSTER_FIELDS:
        return None
    if set(k for k, v in user.items() if v) - _USER_FIELDS:
        return None
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise KubeconfigError(
            f"kubeconfig {path}: clusters[{context['cluster']}].cluster.server must be an "
            f"http(s) URL, not {server!r}"
        )
    base = path.parent

    def pem(section: Mapping[str, Any], name: str, where: str) -> Pem | None:
        data = section.get(f"{name}-data")
        if data:
            try:
                return Pem(data=base64.b64decode(data, validate=True))
            except (ValueError, TypeError) as err:
                raise KubeconfigError(f"kubeconfig {path}: {where}.{name}-data: {err}") from err
        file = section.get(name)
        return Pem(path=base / file) if file else None

    cluster_at = f"clusters[{context['cluster']}].cluster"
    user_at = f"users[{context.get('user')}].user"
    token_file = user.get("tokenFile")
    return ConnectionSettings(
        server=server,
        ca=pem(cluster, "certificate-authority", cluster_at),
        client_cert=pem(user, "client-certificate", user_at),
        client_key=pem(user, "client-key", user_at),
        token=user.get("token") or None,
        token_file=base / token_file if token_file else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        tls_server_name=cluster.get("tls-server-name") or None,
    )


def _named(doc: Mapping[str, Any], section: str, key: str, name: object, path: Path) -> Any:
    for item in doc.get(section) or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(key)
            if not isinstance(value, dict):
                raise KubeconfigError(f"kubeconfig {path}: {section}[{name}].{key} is missing")
            return value
    raise KubeconfigError(f"kubeconfig {path}: {section} has no entry named {name!r}")


def _pool(settings: ConnectionSettings) -> urllib3.PoolManager:
    if not settings.server.startswith("https://"):
        return urllib3.PoolManager(maxsize=POOL_SIZE)
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
    extra: dict[str, Any] = {}
    if settings.tls_server_name:
        extra["server_hostname"] = settings.tls_server_name
    return urllib3.PoolManager(maxsize=POOL_SIZE, ssl_context=context, **extra)


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


def _connect_with_official_loader(kubeconfig: str) -> Connection:
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    api_client = client.ApiClient(configuration)

    def authorization() -> str | None:  # refreshes exec / auth-provider tokens
        bearer = configuration.auth_settings().get("BearerToken")
        return str(bearer["value"]) if bearer and bearer.get("value") else None

    return Connection(configuration.host, api_client.rest_client.pool_manager, authorization)
