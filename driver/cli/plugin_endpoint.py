"""The running plugin's status socket: its /status (`gpu-dra status`, `gpu-dra health`,
`gpu-dra inventory`) and its control requests, /control (`gpu-dra health clear`,
`gpu-dra mock ...`; `driver.health.control_queue` says what the plugin answers).

Where: `--socket`, else `status.sock` in the plugin's data directory (`--state-dir`,
else the standard one): the same path on the node and in the plugin's pod, so
`kubectl exec <plugin pod> -- gpu-dra status` and a node-problem-detector check on the
host need no flag; a debug container with the host at /host gives
`--state-dir /host/var/lib/kubelet/plugins/<driver>`. The socket is root's only
(mode 0600). The plugin answers /status once it has discovered its GPUs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote

from driver.fileio import permission_denied
from driver.health.recovery_taints import KIND_RECOVERY_ACTION
from driver.observability.status_socket import SOCKET_NAME, status_socket_path

DEFAULT_TIMEOUT = 5.0
# Once the plugin took a control request, how much longer than the time it had to take
# it its answer may take (a `clear` waits up to 5 s for the API server).
ANSWER_SLACK = 15.0
CONTROL = "/control"


class PluginUnreachable(Exception):
    """The plugin did not answer; the message says why."""


class ControlRefused(Exception):
    """The plugin answered a control request without applying it; the message says why
    (`status`: the HTTP status, `answer`: its JSON answer, if any)."""

    def __init__(self, message: str, status: int, answer: dict[str, Any] | None) -> None:
        super().__init__(message)
        self.status = status
        self.answer = answer or {}


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over the Unix socket at `path`."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


def add_socket_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"the plugin's status socket (default: <state dir>/{SOCKET_NAME})",
    )


def socket_path(given: Path | None, state_dir: Path) -> Path:
    """`--socket`, else the status socket in `state_dir`."""
    return given if given is not None else status_socket_path(state_dir)


def fetch_status(path: Path, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """The plugin's /status document over the status socket at `path`. Raises
    PluginUnreachable."""
    status, body = exchange(path, "GET", "/status", timeout=timeout)
    if status != 200:
        raise PluginUnreachable(f"{path}: HTTP {status} (is the plugin still starting?)")
    return _document(path, body, "a status")


def fetch_control(path: Path, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """`GET /control`: the running plugin (`pid`, `node`) and the `actions` it accepts.
    Raises PluginUnreachable (a plugin that predates control requests on its socket
    included)."""
    status, body = exchange(path, "GET", CONTROL, timeout=timeout)
    if status == 404:
        raise PluginUnreachable(f"{path}: the plugin predates control requests on its socket")
    if status != 200:
        raise PluginUnreachable(f"{path}: HTTP {status} from {CONTROL}")
    return _document(path, body, "a control")


def post_control(
    path: Path, action: str, request: dict[str, Any], *, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, Any]:
    """`POST /control/<action>`: the plugin's answer to an applied request. The plugin
    withdraws one it did not take within `timeout` seconds. Raises PluginUnreachable or
    ControlRefused (not applied: refused, not accepted, or withdrawn)."""
    target = f"{CONTROL}/{quote(action, safe='')}?timeout={timeout:g}"
    body = json.dumps(request).encode()
    status, data = exchange(path, "POST", target, body, timeout=timeout + ANSWER_SLACK)
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "ok" not in answer:
        raise ControlRefused(
            f"the plugin (HTTP {status}) does not take control requests on its status "
            "socket: it predates them (upgrade the driver on this node)",
            status,
            None,
        )
    if status != 200 or answer.get("ok") is not True:
        raise ControlRefused(str(answer.get("message", f"HTTP {status}")), status, answer)
    return answer


def exchange(
    path: Path, method: str, target: str, body: bytes | None = None, *, timeout: float
) -> tuple[int, bytes]:
    """One request over the status socket at `path`: (HTTP status, body). Raises
    PluginUnreachable."""
    connection = UnixHTTPConnection(path, timeout)
    try:
        headers = {} if body is None else {"Content-Type": "application/json"}
        connection.request(method, target, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    except FileNotFoundError:
        raise PluginUnreachable(f"{path}: no such socket (is the plugin running?)") from None
    except PermissionError:
        raise PluginUnreachable(permission_denied(path)) from None
    except TimeoutError:
        raise PluginUnreachable(f"{path}: no answer within {timeout:g}s") from None
    except OSError as err:  # refused (no plugin behind a stale socket)
        raise PluginUnreachable(f"{path}: {err.strerror or err}") from None
    except http.client.HTTPException as err:  # not HTTP
        raise PluginUnreachable(f"{path}: not an HTTP answer: {err}") from None
    finally:
        connection.close()


def _document(path: Path, body: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError as err:
        raise PluginUnreachable(f"{path}: not {what} answer: {err}") from None
    if not isinstance(document, dict):
        raise PluginUnreachable(f"{path}: not {what} document")
    return document


def recovery_failures(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """GPU UUID -> the NVML recovery action that taints it (`gpus[].failures` of a
    /status document; `driver.health.recovery_taints.RecoveryFailure.to_json`). Only the
    running plugin knows them: it reads NVML, and keeps them in memory."""
    found: dict[str, dict[str, Any]] = {}
    for gpu in document.get("gpus") or []:
        for failure in gpu.get("failures") or []:
            if str(failure.get("key", "")).endswith(f"/{KIND_RECOVERY_ACTION}"):
                found[str(gpu.get("uuid"))] = failure
    return found
