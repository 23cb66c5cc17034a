"""What the kubelet plugin tells about itself: the /healthz text and the checkpoint
gauge (kept out of `main` so that both can be tested without a running plugin).

A corrupt checkpoint (the prepare journal) does NOT fail /healthz. /healthz is the
container's liveness probe, and a restart cannot repair the file: the new process
finds the same file, refuses prepare the same way, and every restart on the way to
CrashLoopBackOff also interrupts what still works with a corrupt journal (unprepare,
the health streams, ResourceSlice publishing) and makes the kubelet drop and
re-register the plugin. A readiness probe would not help either: nothing routes to
a kubelet plugin through a Service, so an unready plugin pod is used as before.
So /healthz answers 200 and names the problem in its text, and
`gpu_dra_checkpoint_corrupt` is 1 for alerting (docs/state.md, "Corrupt checkpoint").
A corrupt health store (every GPU kept failed, `gpu_dra_health_store_corrupt`) is
named the same way, for the same reason (docs/health.md, "Persistence").
"""

from __future__ import annotations

from typing import Protocol

from driver.observability import metrics


class CheckpointHealth(Protocol):
    @property
    def checkpoint_problem(self) -> str | None:
        """Why the journal is unusable, or None (`DeviceState.checkpoint_problem`)."""
        ...


def health_report(
    *,
    registered: bool,
    last_synced: float,
    checkpoint_problem: str | None,
    health_store_problem: str | None = None,
) -> tuple[bool, str]:
    """(healthy, text) for /healthz. Always healthy: see the module docstring.
    `health_store_problem`: `HealthStore.problem`."""
    text = (
        f"ok: {'registered' if registered else 'not registered'}, "
        f"slices synced at {last_synced:.0f}"
    )
    if checkpoint_problem is not None:
        text += f"; CHECKPOINT CORRUPT, prepare refused: {checkpoint_problem}"
    if health_store_problem is not None:
        text += f"; HEALTH STORE CORRUPT, every GPU failed: {health_store_problem}"
    return True, text + "\n"


def export_checkpoint_state(state: CheckpointHealth) -> None:
    """Make `gpu_dra_checkpoint_corrupt` read `state.checkpoint_problem` at each scrape."""
    metrics.CHECKPOINT_CORRUPT.set_function(lambda: float(state.checkpoint_problem is not None))
