"""What the kubelet plugin tells about itself: the /healthz text, the checkpoint gauge
and its start-up recovery in the log (kept out of `main` so that they can be tested
without a running plugin).

A corrupt checkpoint (the prepare journal) does NOT fail /healthz. /healthz is the
container's liveness probe, and a restart cannot repair the file: the new process
finds the same file, refuses prepare the same way, and every restart on the way to
CrashLoopBackOff also interrupts what still works with a corrupt journal (unprepare,
the health streams, ResourceSlice publishing) and makes the kubelet drop and
re-register the plugin. Nor does it make the pod unready: readiness
(`driver.plugin.readiness`) means registered with the kubelet and serving DRA, which
the plugin still is, and a corrupt journal is no reason to keep an upgrade's old pod.
So /healthz answers 200 and names the problem in its text, and
`gpu_dra_checkpoint_corrupt` is 1 for alerting (docs/state.md, "Corrupt checkpoint").
A corrupt health store (every GPU kept failed, `gpu_dra_health_store_corrupt`) is
named the same way, for the same reason (docs/health.md, "Persistence").

/status, the whole picture as JSON for `gpu-dra status`: `driver.plugin.node_status`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from driver.observability import metrics
from driver.observability.http import HttpServer
from driver.observability.status_socket import (
    Control,
    Status,
    StatusSocketServer,
    status_socket_path,
)
from driver.state.recovery.startup_recovery import RecoveryReport

Report = Callable[[], tuple[bool, str]]


class CheckpointHealth(Protocol):
    @property
    def checkpoint_problem(self) -> str | None: ...  # `DeviceState.checkpoint_problem`


class Healthz:
    """/healthz's answer: "starting" until the plugin runs and `serve`s its report."""

    def __init__(self) -> None:
        self._report: Report | None = None

    def serve(self, report: Report) -> None:
        self._report = report

    def __call__(self) -> tuple[bool, str]:
        return self._report() if self._report is not None else (True, "ok: starting\n")


def health_report(
    *,
    registered: bool,
    last_synced: float,
    checkpoint_problem: str | None,
    health_store_problem: str | None = None,
    publish_problem: str | None = None,
) -> tuple[bool, str]:
    """(healthy, text) for /healthz. Always healthy: see the module docstring.
    `last_synced`: when the ResourceSlices were last in sync, a Unix time shown in UTC
    (0: never);
    `health_store_problem`: `HealthStore.problem`; `publish_problem`: why the last
    ResourceSlice publish failed (`PublisherStats.failing`)."""
    synced = (
        f"slices synced at {datetime.fromtimestamp(last_synced, UTC).isoformat(timespec='seconds')}"
        if last_synced
        else "slices not synced yet"
    )
    text = f"ok: {'registered' if registered else 'not registered'}, {synced}"
    if publish_problem is not None:
        text += f"; PUBLISHING FAILS, retrying: {publish_problem}"
    if checkpoint_problem is not None:
        text += f"; CHECKPOINT CORRUPT, prepare refused: {checkpoint_problem}"
    if health_store_problem is not None:
        text += f"; HEALTH STORE CORRUPT, every GPU failed: {health_store_problem}"
    return True, text + "\n"


def describe_recovery(report: RecoveryReport) -> str:
    """The start-up recovery report (`DeviceState.recover()`) for the log: each
    non-empty field as "field name: value" ("swept temp files: 2 (a, b)"), or "nothing
    to do"."""
    parts: list[str] = []
    for field in dataclasses.fields(report):
        value = getattr(report, field.name)
        if not value:
            continue
        name = field.name.replace("_", " ")
        if isinstance(value, tuple | list):
            parts.append(f"{name}: {len(value)} ({', '.join(map(str, value))})")
        else:
            parts.append(f"{name}: {value}")
    return "; ".join(parts) or "nothing to do"


def export_checkpoint_state(state: CheckpointHealth) -> None:
    """Make `gpu_dra_checkpoint_corrupt` read `state.checkpoint_problem` at each scrape."""
    metrics.CHECKPOINT_CORRUPT.set_function(lambda: float(state.checkpoint_problem is not None))


def bind_http(port: int, healthz: Healthz) -> HttpServer | None:
    """The /metrics, /healthz and /readyz server, its port bound but not yet served; None for
    port -1. A port that cannot be bound is a configuration error."""
    if port < 0:
        return None
    try:
        return HttpServer(port, healthz)
    except OSError as err:
        raise ValueError(f"--http-port {port}: cannot listen: {err.strerror or err}") from err


def bind_status_socket(
    data_dir: Path, status: Status, healthz: Healthz, *, control: Control | None = None
) -> StatusSocketServer:
    """The status socket in `data_dir`, bound (mode 0600) but not yet served; it hands
    /control to `control` (the health monitor's control requests)."""
    path = status_socket_path(data_dir)
    try:
        return StatusSocketServer(path, status, healthz, control=control)
    except OSError as err:
        raise ValueError(f"status socket {path}: cannot listen: {err.strerror or err}") from err
