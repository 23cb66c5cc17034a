"""Failed GPUs and failed MIG GPU instances, persisted: the source of every health
taint and of the health stream.

What a record is and which devices it covers: `driver.health.failures`; the file:
`driver.health.persistence`. Taints survive plugin restarts.

Rules: only fatal events are recorded (an ignored event never touches a record, so
it can never weaken a taint); `gpu-lost` beats `xid` (a later Xid on a lost GPU, on
the whole GPU or one of its instances, is not recorded); between two fatal Xids of
the same record the later one wins (value and reason), keeping `since` of the first
failure; `clear(uuid)` forgets a GPU and all its instances once it is known healthy
(NVML's recovery event, `gpu-dra mock reset`, `gpu-dra health clear gpu-<n>`);
`clear_instances(uuid, placement)` forgets the GPU-instance failures on those memory
slices (`gpu-dra health clear <partition>`).

Each change bumps `version` and notifies waiters (`wait_changed`), which the health
stream uses.

A corrupt file (`HealthStoreCorruptError`: garbage, a symlink, a FIFO), or one of a
newer schema version (`HealthStoreNewerError`: a downgrade), fails closed:
which GPUs failed is unknown, so every device shows an `UnknownHealth` failure (taint
`<driver>/health-store-corrupt`) until an operator restores or moves the file aside
and restarts the plugin (docs/health.md). The file is left as it is; failures
recorded meanwhile are published from memory but not written over it.
`gpu_dra_health_store_corrupt` is 1 while so.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from driver.health.failures import (
    DEFAULT_DRIVER_NAME,
    KIND_GPU_LOST,
    KIND_XID,
    Devices,
    GpuFailure,
    HealthDevice,
    Placement,
    device_list,
    device_placement,
    kind_rank,
    now_rfc3339,
    overlaps,
    precedence,
)
from driver.health.persistence import (
    HealthRecords,
    HealthStoreCorruptError,
    load_records,
    write_records,
)
from driver.observability import metrics

# Re-exported: callers take the model's names from here with the store.
__all__ = [
    "DEFAULT_DRIVER_NAME",
    "Devices",
    "HealthDevice",
    "HealthStore",
    "Placement",
    "device_list",
]

log = logging.getLogger(__name__)

KIND_UNKNOWN = "health-store-corrupt"
# The taint effect of UnknownHealth when NoExecute is configured: no GPU is known to
# have failed, so running pods are not evicted; new ones are kept off.
UNKNOWN_EFFECT_FOR_NO_EXECUTE = "NoSchedule"


@dataclass(frozen=True)
class UnknownHealth(GpuFailure):
    """What every device shows while the store's file is corrupt: its health is
    unknown, so it counts as failed. Never persisted; weaker than any recorded failure."""

    def message(self) -> str:
        return f"{self.reason} (since {self.since})"


class HealthStore:
    """Thread-safe, persisted failures (GPU UUID -> GpuFailure, and GPU UUID ->
    placement -> GpuFailure for MIG GPU instances), with change notification."""

    def __init__(
        self,
        path: str | Path,
        *,
        driver: str = DEFAULT_DRIVER_NAME,
        records: HealthRecords | None = None,
    ) -> None:
        """Loads `path`, unless `records` are given (a read-only view: `gpu-dra`)."""
        self.path = Path(path)
        self.driver = driver
        self._cond = threading.Condition(threading.RLock())
        self._version = 0
        self._wakes = 0  # `wake` calls, which end every wait
        self._dirty = False
        self._unknown: UnknownHealth | None = None
        if records is None:
            records = self._load()
        self._failures, self._instances = records.gpus, records.instances

    # -- persistence -------------------------------------------------------------------

    def _load(self) -> HealthRecords:
        try:
            records = load_records(self.path)
        except HealthStoreCorruptError as err:
            self._unknown = UnknownHealth(
                key=f"{self.driver}/{KIND_UNKNOWN}",
                value=None,
                reason=f"{err}: every GPU is kept failed until {err.remedy}",
                since=now_rfc3339(),
            )
            log.error("%s", self._unknown.reason)
            records = HealthRecords()
        metrics.HEALTH_STORE_CORRUPT.set(float(self._unknown is not None))
        if records.gpus:
            log.warning(
                "health store: %d failed GPU(s) remembered from before the restart: %s",
                len(records.gpus),
                ", ".join(f"{u} ({f.message()})" for u, f in sorted(records.gpus.items())),
            )
        if records.instances:
            log.warning(
                "health store: failed MIG GPU instance(s) remembered from before the restart: %s",
                ", ".join(
                    f"{u} ({f.message()})"
                    for u, by in sorted(records.instances.items())
                    for _, f in sorted(by.items())
                ),
            )
        return records

    @property
    def problem(self) -> str | None:
        """Why every GPU is kept failed (the file is corrupt), or None."""
        return self._unknown.reason if self._unknown is not None else None

    def _persist_locked(self) -> None:
        self._dirty = True
        if self._unknown is not None:
            # Writing would replace the corrupt file with one listing only the failures
            # seen since, which the next start would trust: that would fail open.
            log.error("health store: %s is corrupt; change kept in memory only", self.path)
            return
        try:
            write_records(self.path, HealthRecords(self._failures, self._instances))
            self._dirty = False
        except OSError as err:
            # The taint is still published from memory; the next change retries the write.
            log.error("health store: cannot write %s: %s", self.path, err)

    def flush(self) -> bool:
        """Retry a failed write. True when the file is up to date (never while it is
        corrupt)."""
        with self._cond:
            if self._dirty and self._unknown is None:
                self._persist_locked()
            return not self._dirty

    # -- changes -----------------------------------------------------------------------

    def _changed_locked(self) -> None:
        self._persist_locked()
        self._version += 1
        self._cond.notify_all()

    def record_xid(self, gpu_uuid: str, xid: int, reason: str = "") -> bool:
        """A fatal Xid on a GPU. Returns True if the record changed."""
        return self._record(gpu_uuid, KIND_XID, str(xid), reason or f"Xid {xid}")

    def record_lost(self, gpu_uuid: str, reason: str = "") -> bool:
        """The GPU is lost. Returns True if the record changed."""
        return self._record(gpu_uuid, KIND_GPU_LOST, None, reason or "GPU is lost")

    def _record(self, gpu_uuid: str, kind: str, value: str | None, reason: str) -> bool:
        key = f"{self.driver}/{kind}"
        with self._cond:
            current = self._failures.get(gpu_uuid)
            if current is not None and (
                # gpu-lost beats xid; a newer release's kind beats both
                kind_rank(current.kind) > kind_rank(kind)
                or (current.key, current.value) == (key, value)
            ):
                return False
            since = current.since if current is not None and current.kind == kind else now_rfc3339()
            failure = self._failures[gpu_uuid] = GpuFailure(key, value, reason, since)
            self._changed_locked()
            log.warning("GPU %s failed: %s", gpu_uuid, failure.message())
            return True

    def record_instance_xid(
        self,
        gpu_uuid: str,
        placement: Placement,
        xid: int,
        reason: str = "",
        *,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> bool:
        """A fatal Xid NVML attributed to the MIG GPU instance at `placement` (start,
        size in memory slices). Returns True if the record changed."""
        if placement[0] < 0 or placement[1] <= 0:
            raise ValueError(f"bad placement {placement!r}")
        value = str(xid)
        with self._cond:
            gpu = self._failures.get(gpu_uuid)
            if gpu is not None and gpu.kind == KIND_GPU_LOST:
                return False  # gpu-lost beats xid
            current = self._instances.get(gpu_uuid, {}).get(placement)
            if current is not None and (
                # a newer release's kind is never replaced
                kind_rank(current.kind) > kind_rank(KIND_XID)
                or (current.value, current.gpu_instance_id, current.compute_instance_id)
                == (value, gpu_instance_id, compute_instance_id)
            ):
                return False
            failure = GpuFailure(
                f"{self.driver}/{KIND_XID}",
                value,
                reason or f"Xid {xid}",
                current.since if current is not None else now_rfc3339(),
                placement=placement,
                gpu_instance_id=gpu_instance_id,
                compute_instance_id=compute_instance_id,
            )
            self._instances.setdefault(gpu_uuid, {})[placement] = failure
            self._changed_locked()
        log.warning("GPU %s: MIG partition failed: %s", gpu_uuid, failure.message())
        return True

    def clear(self, gpu_uuid: str) -> bool:
        """The GPU is healthy again, with all its GPU instances. Returns True if it had
        a record."""
        with self._cond:
            removed = self._failures.pop(gpu_uuid, None)
            instances = self._instances.pop(gpu_uuid, {})
            if removed is None and not instances:
                return False
            self._changed_locked()
        was = [f.message() for f in ([removed] if removed else []) + list(instances.values())]
        log.warning("GPU %s is healthy again (was: %s)", gpu_uuid, "; ".join(was))
        return True

    def clear_instances(self, gpu_uuid: str, placement: Placement) -> list[GpuFailure]:
        """The GPU-instance failures on these memory slices are repaired; the GPU's own
        failure (if any) stays. Returns the records removed."""
        with self._cond:
            by_placement = self._instances.get(gpu_uuid, {})
            hit = [where for where in sorted(by_placement) if overlaps(placement, where)]
            if not hit:
                return []
            removed = [by_placement.pop(where) for where in hit]
            if not by_placement:
                del self._instances[gpu_uuid]
            self._changed_locked()
        log.warning(
            "GPU %s: MIG partition healthy again (was: %s)",
            gpu_uuid,
            "; ".join(f.message() for f in removed),
        )
        return removed

    def wait_changed(self, version: int, timeout: float) -> int:
        """Block until `version` differs from the current one, `wake` is called or
        `timeout` passes; returns the current version."""
        with self._cond:
            wakes = self._wakes
            self._cond.wait_for(lambda: self._version != version or self._wakes != wakes, timeout)
            return self._version

    def note_change(self) -> None:
        """Health outside this store changed (a GPU's recovery action): waiters in
        `wait_changed` see a new version and read the devices' health again."""
        with self._cond:
            self._changed_locked()

    def wake(self) -> None:
        """Wake every `wait_changed` caller without a change (used on shutdown)."""
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()

    # -- queries -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def device_snapshot(self, devices: Devices) -> tuple[int, dict[str, GpuFailure]]:
        """The version and the failure each failed device shows, by device name."""
        with self._cond:
            return self._version, self.device_failures(devices)

    def gpu_failure(self, gpu_uuid: str) -> GpuFailure | None:
        """The failure of the whole GPU (not of one of its GPU instances)."""
        with self._cond:
            return self._failures.get(gpu_uuid)

    def failed_gpus(self) -> dict[str, GpuFailure]:
        """Whole-GPU failures by GPU UUID."""
        with self._cond:
            return dict(self._failures)

    def failed_instances(self) -> dict[str, dict[Placement, GpuFailure]]:
        """GPU-instance failures by GPU UUID and placement."""
        with self._cond:
            return {u: dict(by) for u, by in self._instances.items()}

    def device_failure(self, device: HealthDevice) -> GpuFailure | None:
        """The failure a device shows: its GPU's, or that of a GPU instance on its
        memory slices (the strongest if several)."""
        placement = device_placement(device)
        with self._cond:
            whole = self._failures.get(device.gpu_uuid)
            found = [whole] if whole is not None else []
            found += [
                f
                for where, f in self._instances.get(device.gpu_uuid, {}).items()
                if overlaps(placement, where)
            ]
            return min(found, key=precedence, default=self._unknown)

    def device_failures(self, devices: Devices) -> dict[str, GpuFailure]:
        """Failed devices by name; devices without a failure are absent."""
        with self._cond:
            failures = {d.name: self.device_failure(d) for d in device_list(devices)}
        return {name: f for name, f in failures.items() if f is not None}

    def device_taints(
        self,
        devices: Devices,
        *,
        driver: str | None = None,
        effect: str = "NoSchedule",
    ) -> dict[str, list[dict[str, str]]]:
        """Taints per device name: a GPU's failure taints every device of that GPU, a
        GPU instance's every device on its memory slices. Devices without a failure
        are absent; while the file is corrupt, none is (`UnknownHealth`, whose taint
        is NoSchedule where `effect` is NoExecute). `timeAdded` is when the failure was
        recorded (`time_added`)."""
        driver = driver or self.driver
        unknown_effect = UNKNOWN_EFFECT_FOR_NO_EXECUTE if effect == "NoExecute" else effect
        return {
            name: [failure.taint(driver, unknown_effect if failure is self._unknown else effect)]
            for name, failure in self.device_failures(devices).items()
        }

    def tainted_device_count(self, devices: Devices) -> int:
        return len(self.device_failures(devices))
