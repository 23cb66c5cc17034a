"""Failed GPUs, persisted: the source of every health taint and of the health stream.

One record per failed GPU (keyed by UUID), written atomically as JSON so that taints
survive plugin restarts:

    {"version": 1, "gpus": {"GPU-...": {"key": "gpu.example.com/xid", "value": "79",
                                         "reason": "Xid 79", "since": "2026-...Z"}}}

Rules: only fatal events are recorded (an ignored event never touches a record, so
it can never weaken a taint); `gpu-lost` beats `xid` (a later Xid on a lost GPU is
not recorded); between two fatal Xids the later one wins (value and reason), keeping
`since` of the first failure; `clear(uuid)` forgets a GPU once it is known healthy.

A failure applies to every device of the GPU: the whole GPU and all its partitions.
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
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

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


@dataclass(frozen=True)
class GpuFailure:
    key: str  # "<driver>/xid" | "<driver>/gpu-lost"
    value: str | None  # the Xid for "xid"; None for "gpu-lost"
    reason: str
    since: str  # RFC 3339, UTC

    @property
    def kind(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def message(self) -> str:
        """Human text for prepare errors and the health stream."""
        what = "GPU is lost" if self.kind == KIND_GPU_LOST else f"Xid {self.value}"
        extra = f": {self.reason}" if self.reason and self.reason != what else ""
        return f"{what}{extra} (since {self.since})"

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


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class HealthStore:
    """Thread-safe, persisted map GPU UUID -> GpuFailure, with change notification."""

    def __init__(self, path: str | Path, *, driver: str = DEFAULT_DRIVER_NAME) -> None:
        self.path = Path(path)
        self.driver = driver
        self._cond = threading.Condition(threading.RLock())
        self._failures: dict[str, GpuFailure] = {}
        self._devices: dict[str, str] = {}  # device name -> GPU UUID
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
                key = str(rec["key"])
                kind = key.rsplit("/", 1)[-1]
                if kind not in _KIND_RANK:
                    log.warning("health store: ignoring unknown failure %r for %s", key, uuid)
                    continue
                value = rec.get("value")
                failures[str(uuid)] = GpuFailure(
                    key=key,
                    value=None if value is None else str(value),
                    reason=str(rec.get("reason", "")),
                    since=str(rec.get("since", "")),
                )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._set_aside(err)
            return
        self._failures = failures
        if failures:
            log.warning(
                "health store: %d failed GPU(s) remembered from before the restart: %s",
                len(failures),
                ", ".join(f"{u} ({f.message()})" for u, f in sorted(failures.items())),
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
        doc = {
            "version": SCHEMA_VERSION,
            "gpus": {uuid: asdict(f) for uuid, f in sorted(self._failures.items())},
        }
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

    def clear(self, gpu_uuid: str) -> bool:
        """The GPU is healthy again. Returns True if it had a record."""
        with self._cond:
            removed = self._failures.pop(gpu_uuid, None)
            if removed is None:
                return False
            self._changed_locked()
        log.warning("GPU %s is healthy again (was: %s)", gpu_uuid, removed.message())
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
        with self._cond:
            return self._version, dict(self._failures)

    def gpu_failure(self, gpu_uuid: str) -> GpuFailure | None:
        with self._cond:
            return self._failures.get(gpu_uuid)

    def failed_gpus(self) -> dict[str, GpuFailure]:
        with self._cond:
            return dict(self._failures)

    def set_devices(self, devices: Devices) -> None:
        """The published devices, for `failure(device_name)`."""
        mapping = {d.name: d.gpu_uuid for d in device_list(devices)}
        with self._cond:
            self._devices = mapping

    def failure(self, device_name: str) -> str | None:
        """Why the device is unusable, or None. Non-blocking; needs `set_devices`."""
        with self._cond:
            uuid = self._devices.get(device_name)
            failure = self._failures.get(uuid) if uuid is not None else None
        return failure.message() if failure is not None else None

    def device_taints(
        self,
        devices: Devices,
        *,
        driver: str | None = None,
        effect: str = "NoSchedule",
    ) -> dict[str, list[dict[str, str]]]:
        """Taints per device name: a GPU's failure taints every device of that GPU.
        Devices without a failure are absent. `timeAdded` is left to the API server."""
        driver = driver or self.driver
        failures = self.failed_gpus()
        out: dict[str, list[dict[str, str]]] = {}
        for device in device_list(devices):
            failure = failures.get(device.gpu_uuid)
            if failure is not None:
                out[device.name] = [failure.taint(driver, effect)]
        return out

    def tainted_device_count(self, devices: Devices) -> int:
        failures = self.failed_gpus()
        return sum(1 for d in device_list(devices) if d.gpu_uuid in failures)
