"""Failed GPUs and failed MIG GPU instances, persisted: the source of every health
taint and of the health stream.

Two kinds of record, written atomically as JSON so that taints survive plugin
restarts:

- a failure of a whole GPU (keyed by UUID): any event NVML does not attribute to a
  MIG GPU instance (an Xid outside MIG or of the whole GPU, a double-bit ECC error,
  a lost GPU). It applies to every device of the GPU: the whole GPU and all its
  partitions.
- a failure of one MIG GPU instance (keyed by GPU UUID and the instance's placement
  in memory slices): an Xid NVML attributes to a GPU instance. It applies to every
  device of that GPU whose memory slices intersect the placement: the partition
  itself, any larger partition containing it, and the whole GPU; never a partition
  on other slices. The placement, not the GPU-instance ID, is the key: a dynamic
  partition's GPU instance exists only while it is prepared, its published device
  is named after its placement.

    {"version": 1,
     "gpus": {"GPU-...": {"key": "gpu.example.com/xid", "value": "79",
                          "reason": "Xid 79", "since": "2026-...Z"}},
     "instances": {"GPU-...": [{"start": 3, "size": 1, "gpuInstanceId": 9,
                                "computeInstanceId": 0, "key": "gpu.example.com/xid",
                                "value": "94", "reason": "Xid 94", "since": "..."}]}}

`instances` is written only when there is one (a file without it reads as before;
an older plugin reading a newer file ignores it).

Rules: only fatal events are recorded (an ignored event never touches a record, so
it can never weaken a taint); `gpu-lost` beats `xid` (a later Xid on a lost GPU, on
the whole GPU or one of its instances, is not recorded); between two fatal Xids of
the same record the later one wins (value and reason), keeping `since` of the first
failure; `clear(uuid)` forgets a GPU and all its instances once it is known healthy
(NVML's recovery event and `gpu-dra mock reset` are per GPU). A device covered by
several records shows the strongest (gpu-lost over xid, the whole GPU's over an
instance's).

Each change bumps `version` and notifies waiters (`wait_changed`), which the health
stream uses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from driver.state.cdi import UnsafeFileError, read_file_nofollow
from driver.state.fileio import atomic_write

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_DRIVER_NAME = "gpu.example.com"
KIND_XID = "xid"
KIND_GPU_LOST = "gpu-lost"
_KIND_RANK = {KIND_XID: 1, KIND_GPU_LOST: 2}


class HealthDevice(Protocol):
    """What the health code needs of a published device (`PublishedDevice`)."""

    @property
    def name(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...


Placement = tuple[int, int]  # (start, size) in memory slices


@dataclass(frozen=True)
class GpuFailure:
    key: str  # "<driver>/xid" | "<driver>/gpu-lost"
    value: str | None  # the Xid for "xid"; None for "gpu-lost"
    reason: str
    since: str  # RFC 3339, UTC
    # A failure of one MIG GPU instance: its placement and the IDs NVML attributed
    # the Xid to. All None for a failure of the whole GPU.
    placement: Placement | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def kind(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def whole_gpu(self) -> bool:
        return self.placement is None

    def scope(self) -> str:
        """Where the failure is: "" for the whole GPU, else the GPU instance."""
        if self.placement is None:
            return ""
        start, size = self.placement
        slices = (
            f"memory slice {start}" if size == 1 else f"memory slices {start}-{start + size - 1}"
        )
        if self.gpu_instance_id is None:
            return f"MIG partition at {slices}"
        ci = "" if self.compute_instance_id is None else f"/{self.compute_instance_id}"
        return f"GPU instance {self.gpu_instance_id}{ci} at {slices}"

    def message(self) -> str:
        """Human text for prepare errors and the health stream."""
        what = "GPU is lost" if self.kind == KIND_GPU_LOST else f"Xid {self.value}"
        extra = f": {self.reason}" if self.reason and self.reason != what else ""
        where = f" on {self.scope()}" if self.placement is not None else ""
        return f"{what}{where}{extra} (since {self.since})"

    def taint(self, driver: str, effect: str) -> dict[str, str]:
        taint = {"key": f"{driver}/{self.kind}", "effect": effect}
        if self.value is not None:
            taint["value"] = self.value
        return taint


Devices = Iterable[HealthDevice] | Mapping[str, HealthDevice]


def device_list(devices: Devices) -> list[HealthDevice]:
    """Devices given as a sequence or as a name -> device mapping."""
    if isinstance(devices, Mapping):
        return list(devices.values())
    return list(devices)


def device_placement(device: object) -> Placement | None:
    """The memory slices a published device occupies: a MIG partition's placement, the
    whole GPU's full-size placement in dynamic MIG mode; None for a device that is
    the whole GPU (or not a MIG device), which every GPU instance intersects."""
    placement = getattr(device, "placement", None)
    if placement is None:
        placement = getattr(getattr(device, "mig", None), "placement", None)
    if placement is None:
        return None
    start, size = placement
    return (int(start), int(size))


def overlaps(a: Placement | None, b: Placement) -> bool:
    """Whether the memory slices of `a` (None: the whole GPU) and `b` intersect."""
    if a is None:
        return True
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _precedence(failure: GpuFailure) -> tuple[int, bool, Placement]:
    """Sort key, strongest first: gpu-lost, then the whole GPU's, then by placement."""
    return (-_KIND_RANK[failure.kind], not failure.whole_gpu, failure.placement or (0, 0))


def _failure_record(failure: GpuFailure) -> dict[str, Any]:
    return {
        "key": failure.key,
        "value": failure.value,
        "reason": failure.reason,
        "since": failure.since,
    }


def _optional_id(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"bad instance ID {value!r}")
    return value


class HealthStore:
    """Thread-safe, persisted failures (GPU UUID -> GpuFailure, and GPU UUID ->
    placement -> GpuFailure for MIG GPU instances), with change notification."""

    def __init__(self, path: str | Path, *, driver: str = DEFAULT_DRIVER_NAME) -> None:
        self.path = Path(path)
        self.driver = driver
        self._cond = threading.Condition(threading.RLock())
        self._failures: dict[str, GpuFailure] = {}
        self._instances: dict[str, dict[Placement, GpuFailure]] = {}
        # device name -> (GPU UUID, placement)
        self._devices: dict[str, tuple[str, Placement | None]] = {}
        self._version = 0
        self._dirty = False
        self._load()

    # -- persistence -------------------------------------------------------------------

    def _load(self) -> None:
        try:
            raw = read_file_nofollow(self.path)
        except FileNotFoundError:
            return
        except UnsafeFileError as err:  # a symlink is never followed: set aside, not read
            self._set_aside(err)
            return
        try:
            doc = json.loads(raw)
            gpus = doc["gpus"]
            if not isinstance(gpus, dict):
                raise TypeError("gpus is not an object")
            failures: dict[str, GpuFailure] = {}
            for uuid, rec in gpus.items():
                failure = self._parse_failure(rec, str(uuid))
                if failure is not None:
                    failures[str(uuid)] = failure
            instances: dict[str, dict[Placement, GpuFailure]] = {}
            raw_instances = doc.get("instances", {})
            if not isinstance(raw_instances, dict):
                raise TypeError("instances is not an object")
            for uuid, records in raw_instances.items():
                if not isinstance(records, list):
                    raise TypeError(f"instances of {uuid} is not a list")
                for rec in records:
                    failure = self._parse_failure(rec, str(uuid))
                    if failure is not None and failure.placement is not None:
                        instances.setdefault(str(uuid), {})[failure.placement] = failure
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._set_aside(err)
            return
        self._failures = failures
        self._instances = instances
        if failures:
            log.warning(
                "health store: %d failed GPU(s) remembered from before the restart: %s",
                len(failures),
                ", ".join(f"{u} ({f.message()})" for u, f in sorted(failures.items())),
            )
        if instances:
            log.warning(
                "health store: failed MIG GPU instance(s) remembered from before the restart: %s",
                ", ".join(
                    f"{u} ({f.message()})"
                    for u, by in sorted(instances.items())
                    for _, f in sorted(by.items())
                ),
            )

    @staticmethod
    def _parse_failure(rec: Any, uuid: str) -> GpuFailure | None:
        """One record; None for an unknown kind (a newer plugin's). Raises on garbage."""
        key = str(rec["key"])
        kind = key.rsplit("/", 1)[-1]
        if kind not in _KIND_RANK:
            log.warning("health store: ignoring unknown failure %r for %s", key, uuid)
            return None
        value = rec.get("value")
        placement: Placement | None = None
        if "start" in rec or "size" in rec:
            start, size = rec["start"], rec["size"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, size)):
                raise TypeError(f"bad placement {start!r}+{size!r} for {uuid}")
            if start < 0 or size <= 0:
                raise ValueError(f"bad placement {start}+{size} for {uuid}")
            placement = (start, size)
        return GpuFailure(
            key=key,
            value=None if value is None else str(value),
            reason=str(rec.get("reason", "")),
            since=str(rec.get("since", "")),
            placement=placement,
            gpu_instance_id=_optional_id(rec.get("gpuInstanceId")),
            compute_instance_id=_optional_id(rec.get("computeInstanceId")),
        )

    def _set_aside(self, err: Exception) -> None:
        """Move an unreadable file (or a symlink: the link itself) aside; start empty."""
        quarantine = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, quarantine)
        log.error(
            "health store %s is unreadable (%s); moved to %s, starting with no failed GPUs",
            self.path,
            err,
            quarantine,
        )

    def _persist_locked(self) -> None:
        doc: dict[str, Any] = {
            "version": SCHEMA_VERSION,
            "gpus": {uuid: _failure_record(f) for uuid, f in sorted(self._failures.items())},
        }
        instances = {
            uuid: [
                {
                    "start": placement[0],
                    "size": placement[1],
                    "gpuInstanceId": f.gpu_instance_id,
                    "computeInstanceId": f.compute_instance_id,
                    **_failure_record(f),
                }
                for placement, f in sorted(by_placement.items())
            ]
            for uuid, by_placement in sorted(self._instances.items())
            if by_placement
        }
        if instances:
            doc["instances"] = instances
        data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(self.path, data, mode=0o600)
            self._dirty = False
        except OSError as err:
            # The taint is still published from memory; the next change retries the write.
            self._dirty = True
            log.error("health store: cannot write %s: %s", self.path, err)

    def flush(self) -> bool:
        """Retry a failed write. True when the file is up to date."""
        with self._cond:
            if self._dirty:
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
            if current is not None:
                if _KIND_RANK[current.kind] > _KIND_RANK[kind]:
                    return False  # gpu-lost beats xid
                if current.key == key and current.value == value:
                    return False
                since = current.since if current.kind == kind else _now_rfc3339()
            else:
                since = _now_rfc3339()
            self._failures[gpu_uuid] = GpuFailure(key, value, reason, since)
            self._changed_locked()
            log.warning("GPU %s failed: %s", gpu_uuid, self._failures[gpu_uuid].message())
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
        start, size = placement
        if start < 0 or size <= 0:
            raise ValueError(f"bad placement {placement!r}")
        placement = (int(start), int(size))
        key = f"{self.driver}/{KIND_XID}"
        value = str(xid)
        with self._cond:
            gpu = self._failures.get(gpu_uuid)
            if gpu is not None and gpu.kind == KIND_GPU_LOST:
                return False  # gpu-lost beats xid
            by_placement = self._instances.setdefault(gpu_uuid, {})
            current = by_placement.get(placement)
            if current is not None and (
                current.value,
                current.gpu_instance_id,
                current.compute_instance_id,
            ) == (value, gpu_instance_id, compute_instance_id):
                return False
            since = current.since if current is not None else _now_rfc3339()
            failure = GpuFailure(
                key,
                value,
                reason or f"Xid {xid}",
                since,
                placement=placement,
                gpu_instance_id=gpu_instance_id,
                compute_instance_id=compute_instance_id,
            )
            by_placement[placement] = failure
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

    def wait_changed(self, version: int, timeout: float) -> int:
        """Block until `version` differs from the current one or `timeout` passes;
        returns the current version."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._version == version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._version

    def wake(self) -> None:
        """Wake every `wait_changed` caller without a change (used on shutdown)."""
        with self._cond:
            self._cond.notify_all()

    # -- queries -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def snapshot(self) -> tuple[int, dict[str, GpuFailure]]:
        """The version and the whole-GPU failures (see `device_snapshot` for what
        each device shows, GPU-instance failures included)."""
        with self._cond:
            return self._version, dict(self._failures)

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
            return {u: dict(by) for u, by in self._instances.items() if by}

    def _failure_locked(self, gpu_uuid: str, placement: Placement | None) -> GpuFailure | None:
        found: list[GpuFailure] = []
        whole = self._failures.get(gpu_uuid)
        if whole is not None:
            found.append(whole)
        for where, failure in self._instances.get(gpu_uuid, {}).items():
            if overlaps(placement, where):
                found.append(failure)
        return min(found, key=_precedence) if found else None

    def device_failure(self, device: HealthDevice) -> GpuFailure | None:
        """The failure a device shows: its GPU's, or that of a GPU instance on its
        memory slices (the strongest if several)."""
        with self._cond:
            return self._failure_locked(device.gpu_uuid, device_placement(device))

    def device_failures(self, devices: Devices) -> dict[str, GpuFailure]:
        """Failed devices by name; devices without a failure are absent."""
        out: dict[str, GpuFailure] = {}
        with self._cond:
            for device in device_list(devices):
                failure = self._failure_locked(device.gpu_uuid, device_placement(device))
                if failure is not None:
                    out[device.name] = failure
        return out

    def set_devices(self, devices: Devices) -> None:
        """The published devices, for `failure(device_name)`."""
        mapping = {d.name: (d.gpu_uuid, device_placement(d)) for d in device_list(devices)}
        with self._cond:
            self._devices = mapping

    def failure(self, device_name: str) -> str | None:
        """Why the device is unusable, or None. Non-blocking; needs `set_devices`."""
        with self._cond:
            where = self._devices.get(device_name)
            failure = self._failure_locked(*where) if where is not None else None
        return failure.message() if failure is not None else None

    def device_taints(
        self,
        devices: Devices,
        *,
        driver: str | None = None,
        effect: str = "NoSchedule",
    ) -> dict[str, list[dict[str, str]]]:
        """Taints per device name: a GPU's failure taints every device of that GPU, a
        GPU instance's every device on its memory slices. Devices without a failure
        are absent. `timeAdded` is left to the API server."""
        driver = driver or self.driver
        return {
            name: [failure.taint(driver, effect)]
            for name, failure in self.device_failures(devices).items()
        }

    def tainted_device_count(self, devices: Devices) -> int:
        return len(self.device_failures(devices))
