"""Where the API server is and who the driver is to it: the current context of a
kubeconfig (one file, or several joined by `:` as in $KUBECONFIG, merged as kubectl
merges them) or the in-cluster service account, read into `ConnectionSettings`.
Fields this driver does not read are refused with their name (driver/kube/connection.py
turns the settings into a connection)."""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
EXEC_API_VERSIONS = frozenset(
    {"client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"}
)

_CLUSTER_FIELDS = frozenset(
    {
        "server",
        "certificate-authority",
        "certificate-authority-data",
        "insecure-skip-tls-verify",
        "tls-server-name",
        "proxy-url",
        "disable-compression",  # nothing here asks for compression
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
        "exec",
        "extensions",
    }
)
_UNSUPPORTED_USER_FIELDS = {
    "auth-provider": "auth providers are not supported; use an exec credential plugin (exec)",
    "username": "basic auth is not supported (the API server dropped it in 1.19)",
    "password": "basic auth is not supported (the API server dropped it in 1.19)",
    "as": "impersonation is not supported",
    "as-uid": "impersonation is not supported",
    "as-groups": "impersonation is not supported",
    "as-user-extra": "impersonation is not supported",
}


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
class ExecPlugin:
    """A kubeconfig user's `exec` section: the command that prints an ExecCredential."""

    where: str  # the field, for errors: users[<name>].user.exec
    command: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    api_version: str


@dataclass(frozen=True)
class ConnectionSettings:
    server: str
    ca: Pem | None = None
    client_cert: Pem | None = None
    client_key: Pem | None = None
    token: str | None = None
    token_file: Path | None = None
    exec_plugin: ExecPlugin | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    proxy_url: str | None = None


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


def read_kubeconfig(kubeconfig: str | os.PathLike[str]) -> ConnectionSettings:
    """The current context's settings from a kubeconfig file, or from several joined by
    `:` (merged: the first file to set current-context or to name an entry wins, and
    files of the list that do not exist are skipped, as kubectl does)."""
    config = _Kubeconfig(str(kubeconfig))
    context_name = config.current_context
    if not context_name:
        raise config.error("current-context is not set")
    context, _ = config.named("contexts", "context", context_name)
    cluster_name, user_name = context.get("cluster"), context.get("user")
    cluster, cluster_base = config.named("clusters", "cluster", cluster_name)
    user, user_base = config.named("users", "user", user_name) if user_name else ({}, Path())
    cluster_at = f"clusters[{cluster_name}].cluster"
    user_at = f"users[{user_name}].user"
    unknown = sorted(k for k, v in cluster.items() if v and k not in _CLUSTER_FIELDS)
    if unknown:
        raise config.error(f"{cluster_at}.{unknown[0]} is not supported")
    unknown = sorted(k for k, v in user.items() if v and k not in _USER_FIELDS)
    if unknown:
        why = _UNSUPPORTED_USER_FIELDS.get(unknown[0], "not supported")
        raise config.error(f"{user_at}.{unknown[0]}: {why}")
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise config.error(f"{cluster_at}.server must be an http(s) URL, not {server!r}")
    proxy_url = cluster.get("proxy-url") or None
    if proxy_url is not None and not str(proxy_url).startswith(("https://", "http://")):
        raise config.error(
            f"{cluster_at}.proxy-url must be an http(s) URL (no socks), not {proxy_url!r}"
        )

    def pem(section: Mapping[str, Any], name: str, where: str, base: Path) -> Pem | None:
        data = section.get(f"{name}-data")
        if data:
            try:
                return Pem(data=base64.b64decode(data, validate=True))
            except (ValueError, TypeError) as err:
                raise config.error(f"{where}.{name}-data: {err}") from err
        file = section.get(name)
        return Pem(path=base / file) if file else None

    token_file, exec_section = user.get("tokenFile"), user.get("exec")
    return ConnectionSettings(
        server=server,
        ca=pem(cluster, "certificate-authority", cluster_at, cluster_base),
        client_cert=pem(user, "client-certificate", user_at, user_base),
        client_key=pem(user, "client-key", user_at, user_base),
        token=user.get("token") or None,
        token_file=user_base / token_file if token_file else None,
        exec_plugin=(
            _exec_plugin(exec_section, f"{user_at}.exec", config, user_base)
            if exec_section
            else None
        ),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        tls_server_name=cluster.get("tls-server-name") or None,
        proxy_url=proxy_url,
    )


class _Kubeconfig:
    """One kubeconfig file or several merged, each entry with the directory of the file
    that named it (relative paths in it are relative to that file)."""

    def __init__(self, kubeconfig: str) -> None:
        self.name = kubeconfig
        self.current_context: str | None = None
        self._entries: dict[tuple[str, object], tuple[Any, Path]] = {}
        paths = [Path(p) for p in kubeconfig.split(os.pathsep) if p]
        # Files of a list that do not exist are skipped (kubectl); a single one must exist.
        read = [p for p in paths if len(paths) == 1 or p.is_file()]
        for path in read:
            self._add(path, self._load(path))
        if not read:
            raise self.error("none of its files exists")

    def _load(self, path: Path) -> dict[str, Any]:
        import yaml  # here only: an in-cluster plugin (no kubeconfig file) never loads it

        try:
            doc = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except OSError as err:
            raise KubeconfigError(f"kubeconfig {path}: {err.strerror}") from err
        except yaml.YAMLError as err:
            raise KubeconfigError(f"kubeconfig {path}: not YAML: {err}") from err
        if not isinstance(doc, dict):
            raise KubeconfigError(f"kubeconfig {path}: not a mapping")
        return doc

    def _add(self, path: Path, doc: Mapping[str, Any]) -> None:
        self.current_context = self.current_context or doc.get("current-context") or None
        for section in ("contexts", "clusters", "users"):
            for item in doc.get(section) or []:
                if isinstance(item, dict):
                    self._entries.setdefault((section, item.get("name")), (item, path.parent))

    def named(self, section: str, key: str, name: object) -> tuple[Any, Path]:
        """(the entry's `key` mapping, its file's directory)."""
        if (section, name) not in self._entries:
            raise self.error(f"{section} has no entry named {name!r}")
        item, base = self._entries[section, name]
        value = item.get(key)
        if not isinstance(value, dict):
            raise self.error(f"{section}[{name}].{key} is missing")
        return value, base

    def error(self, detail: str) -> KubeconfigError:
        return KubeconfigError(f"kubeconfig {self.name}: {detail}")


def _exec_plugin(section: Any, where: str, config: _Kubeconfig, base: Path) -> ExecPlugin:
    def fail(detail: str) -> KubeconfigError:
        return config.error(f"{where}{detail}")

    if not isinstance(section, dict):
        raise fail(" is not a mapping")
    command, api_version = section.get("command"), section.get("apiVersion")
    if not isinstance(command, str) or not command:
        raise fail(".command is missing")
    if api_version not in EXEC_API_VERSIONS:
        raise fail(f".apiVersion must be one of {sorted(EXEC_API_VERSIONS)}, not {api_version!r}")
    if section.get("interactiveMode") == "Always":
        raise fail(".interactiveMode: Always is not supported (nothing here has a terminal)")
    if section.get("provideClusterInfo"):
        raise fail(".provideClusterInfo is not supported")
    args = section.get("args") or []
    env = section.get("env") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise fail(".args must be a list of strings")
    if not isinstance(env, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("value"), str)
        for e in env
    ):
        raise fail(".env must be a list of {name, value} strings")
    if os.sep in command and not os.path.isabs(command):
        command = str(base / command)  # as kubectl: relative to the kubeconfig's file
    return ExecPlugin(
        where=where,
        command=command,
        args=tuple(args),
        env=tuple((e["name"], e["value"]) for e in env),
        api_version=api_version,
    )
