"""The running plugin's /status, over its status socket (`gpu-dra status`, `gpu-dra
health`, `gpu-dra inventory`).

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

from driver.health.recovery import KIND_RECOVERY_ACTION
from driver.observability.status_socket import SOCKET_NAME, status_socket_path
from driver.state.fileio import permission_denied

DEFAULT_TIMEOUT = 5.0


class PluginUnreachable(Exception):
    """The plugin did not answer /status; the message says why."""


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
    connection = UnixHTTPConnection(path, timeout)
    try:
        connection.request("GET", "/status")
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise PluginUnreachable(
                f"{path}: HTTP {response.status} (is the plugin still starting?)"
            )
        document = json.loads(body)
    except FileNotFoundError:
        raise PluginUnreachable(f"{path}: no such socket (is the plugin running?)") from None
    except PermissionError:
        raise PluginUnreachable(permission_denied(path)) from None
    except OSError as err:  # refused (no plugin behind a stale socket), timed out
        raise PluginUnreachable(f"{path}: {err.strerror or err}") from None
    except (http.client.HTTPException, ValueError) as err:  # not HTTP, not JSON
        raise PluginUnreachable(f"{path}: not a status answer: {err}") from None
    finally:
        connection.close()
    if not isinstance(document, dict):
        raise PluginUnreachable(f"{path}: not a status document")
    return document


def recovery_failures(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """GPU UUID -> the NVML recovery action that taints it (`gpus[].failures` of a
    /status document; `driver.health.recovery.RecoveryFailure.to_json`). Only the
    running plugin knows them: it reads NVML, and keeps them in memory."""
    found: dict[str, dict[str, Any]] = {}
    for gpu in document.get("gpus") or []:
        for failure in gpu.get("failures") or []:
            if str(failure.get("key", "")).endswith(f"/{KIND_RECOVERY_ACTION}"):
                found[str(gpu.get("uuid"))] = failure
    return found
