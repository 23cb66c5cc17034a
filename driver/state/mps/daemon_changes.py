"""What became of a prepared device's MPS daemon that was lost or replaced, as
driver/state/mps/claim_daemons.py reports it at start and driver/state/mps_watch.py
while the plugin runs (docs/mps.md, "Lifecycle")."""

from __future__ import annotations

from dataclasses import dataclass

from driver.state.journal.mps_record import MpsRecord


@dataclass(frozen=True)
class MpsLoss:
    """A device's daemon found gone, and what became of it: started again
    (`restarted`, its new record) or not (`error`)."""

    device: str
    lost: MpsRecord
    restarted: MpsRecord | None = None
    error: str | None = None

    @property
    def outcome(self) -> str:
        """The label of gpu_dra_mps_daemon_lost_total."""
        return "failed" if self.restarted is None else "restarted"


def daemon_text(record: MpsRecord) -> str:
    """`Deployment <name>` or `pid <pid>`: which daemon the record names."""
    return f"Deployment {record.deployment}" if record.deployment else f"pid {record.pid}"


@dataclass(frozen=True)
class MpsReplaced:
    """A device's daemon that Kubernetes started again behind the driver's back: its
    pod replaced (a new UID) or its container restarted. Its clients' work is gone."""

    device: str
    record: MpsRecord  # as observed now
    change: str  # `its pod was replaced (...)`, `its container restarted (...)`


def change_seen(before: MpsRecord, now: MpsRecord) -> str | None:
    """How the daemon's pod changed since `before` was recorded, None if it did not."""
    if before.pod_uid and now.pod_uid and now.pod_uid != before.pod_uid:
        return f"its pod was replaced (pod UID {before.pod_uid} -> {now.pod_uid})"
    if now.pod_restarts > before.pod_restarts:
        return f"its container restarted ({now.pod_restarts} restart(s) of pod {now.pod_uid})"
    return None
