"""The running plugin's /status, over its HTTP port (`gpu-dra status`, `gpu-dra health`,
`gpu-dra inventory`).

Where: `--plugin-url`, else `http://127.0.0.1:$HTTP_PORT` (the chart sets HTTP_PORT in
the plugin's pod, so `kubectl exec <plugin pod> -- gpu-dra status` needs no flag),
else port 8080. The plugin answers /status once it has discovered its GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from driver.health.recovery import KIND_RECOVERY_ACTION

PORT_ENV = "HTTP_PORT"
DEFAULT_PORT = 8080
DEFAULT_TIMEOUT = 5.0


class PluginUnreachable(Exception):
    """The plugin did not answer /status; the message says why."""


def default_url() -> str:
    return f"http://127.0.0.1:{os.environ.get(PORT_ENV) or DEFAULT_PORT}"


def plugin_url(text: str) -> str:
    """An http(s) URL with a host: the plugin's HTTP endpoint."""
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"not an http:// URL with a host: {text!r}")
    return text.rstrip("/")


def add_plugin_url_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin-url",
        type=plugin_url,
        default=None,
        metavar="URL",
        help=f"the plugin's HTTP endpoint (default: http://127.0.0.1:${PORT_ENV}, "
        f"else port {DEFAULT_PORT})",
    )


def fetch_status(url: str | None, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """The plugin's /status document. Raises PluginUnreachable."""
    target = f"{url or default_url()}/status"
    # No proxy: the plugin is on this node, and $http_proxy rarely exempts 127.0.0.1.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(target, timeout=timeout) as response:
            document = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise PluginUnreachable(
            f"{target}: HTTP {err.code} (is the plugin still starting?)"
        ) from None
    except (OSError, ValueError) as err:  # refused, timeout, not JSON
        reason = getattr(err, "reason", None) or err
        raise PluginUnreachable(f"{target}: {reason}") from None
    if not isinstance(document, dict):
        raise PluginUnreachable(f"{target}: not a status document")
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
