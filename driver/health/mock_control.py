"""Control channel from `gpu-dra mock ...` to a running plugin's mock NVML.

Transport: a root-only spool directory `<state-dir>/mock-control/` (0700, files 0600).

- The plugin (mock backend only) creates it, writes `ACTIVE` (JSON: pid, node, start
  time) and touches that file at least every second while it polls (`MockControl.poll`,
  run by the health monitor on every event wait, i.e. every <=100 ms).
- The CLI (`submit`) refuses to write a request unless `ACTIVE` is fresh, then writes
  `req-<id>.json` atomically (a dot-prefixed temp file renamed into place) and waits
  for the plugin's answer `res-<id>.json`, which it removes.
- The plugin translates device names (`gpu-3`, a partition name, or a GPU UUID) to
  the GPU and calls `MockNvml.inject(...)`; the event then travels the same path as a
  real NVML event (event wait -> classification -> store -> taint).
- `xid` with `"instance": true` attributes the Xid to the device's live MIG GPU
  instance, as NVML does for an Xid inside a partition: the plugin finds the GPU
  instance at the device's placement in the live MIG state and injects the event
  with its GPU- and compute-instance IDs. The answer then carries `instance` (the
  IDs and placement); a CLI that asked for an instance and gets no `instance` back
  talks to a plugin that predates it (which injected a whole-GPU Xid). The key is
  written only when true, so every other request is byte-for-byte what it was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from driver.health.store import Devices, HealthDevice, device_list, device_placement
from driver.nvml.types import HealthEvent, MigInstance
from driver.state.fileio import atomic_write

log = logging.getLogger(__name__)

DEFAULT_DRIVER_NAME = "gpu.example.com"
DEFAULT_STATE_DIR = Path("/var/lib/kubelet/plugins") / DEFAULT_DRIVER_NAME
SPOOL_NAME = "mock-control"
ACTIVE_NAME = "ACTIVE"
HEARTBEAT_SECONDS = 1.0
STALE_AFTER_SECONDS = 10.0
MAX_REQUEST_BYTES = 4096
ACTIONS = ("xid", "lost", "reset")

_REQUEST_RE = re.compile(r"^req-([0-9a-f]{16,64})\.json$")
_DEVICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class MockControlError(Exception):
    """A request that cannot be delivered or was refused; the message says why."""


def spool_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / SPOOL_NAME


@dataclass(frozen=True)
class MockRequest:
    action: str  # "xid" | "lost" | "reset"
    device: str | None = None
    xid: int | None = None
    all: bool = False
    instance: bool = False  # xid only: attribute it to the device's live GPU instance

    def validate(self) -> None:
        if self.action not in ACTIONS:
            raise MockControlError(f"unknown action {self.action!r}")
        if self.all:
            if self.action != "reset":
                raise MockControlError(f"--all is only valid for reset, not {self.action}")
            if self.device is not None:
                raise MockControlError("give either --device or --all, not both")
        elif self.device is None or not _DEVICE_RE.match(self.device):
            raise MockControlError(f"invalid device name {self.device!r}")
        if self.action == "xid":
            if self.xid is None or not 0 < self.xid <= 0xFFFFFFFF:
                raise MockControlError(f"invalid Xid {self.xid!r} (1..4294967295)")
        elif self.xid is not None:
            raise MockControlError(f"--xid is only valid for the xid action, not {self.action}")
        if self.instance and self.action != "xid":
            raise MockControlError(
                f"--instance is only valid for the xid action, not {self.action}"
            )

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "action": self.action,
            "device": self.device,
            "xid": self.xid,
            "all": self.all,
        }
        if self.instance:
            doc["instance"] = True
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MockRequest:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            request = cls(
                action=str(doc["action"]),
                device=None if doc.get("device") is None else str(doc["device"]),
                xid=None if doc.get("xid") is None else int(doc["xid"]),
                all=bool(doc.get("all", False)),
                instance=bool(doc.get("instance", False)),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise MockControlError(f"malformed request: {err}") from None
        request.validate()
        return request

    def describe(self) -> str:
        target = "all GPUs" if self.all else self.device
        if self.action == "xid":
            where = f"the GPU instance of {target}" if self.instance else target
            return f"Xid {self.xid} on {where}"
        if self.action == "lost":
            return f"GPU lost on {target}"
        return f"reset of {target}"


class _MockGpu(Protocol):
    @property
    def uuid(self) -> str: ...
    @property
    def minor(self) -> int: ...


class InjectableNvml(Protocol):
    """What the control channel needs of `MockNvml`."""

    @property
    def gpus(self) -> list[Any]: ...

    def inject(self, event: HealthEvent) -> None: ...


MigInstances = Callable[[str], Iterable[MigInstance]]  # GPU UUID -> live GPU instances


def _live_instances(nvml: InjectableNvml) -> MigInstances:
    from driver.nvml.mig import MigManager

    def instances(gpu_uuid: str) -> Iterable[MigInstance]:
        return MigManager(nvml).instances(gpu_uuid)

    return instances


# -- plugin side ---------------------------------------------------------------------


class MockControl:
    """Consumes the spool in the plugin. Call `activate()` once, `poll()` often,
    `close()` on shutdown."""

    def __init__(
        self,
        state_dir: str | Path,
        nvml: InjectableNvml,
        devices: Devices = (),
        *,
        node_name: str = "",
        mig_instances: MigInstances | None = None,
    ) -> None:
        self.dir = spool_dir(state_dir)
        self._nvml = nvml
        self._node = node_name
        gpus: list[_MockGpu] = list(nvml.gpus)
        self._uuids = [g.uuid for g in gpus]
        self._names: dict[str, str] = {f"gpu-{g.minor}": g.uuid for g in gpus}
        self._names.update({g.uuid: g.uuid for g in gpus})
        self._devices: dict[str, HealthDevice] = {d.name: d for d in device_list(devices)}
        self._names.update({name: d.gpu_uuid for name, d in self._devices.items()})
        self._mig_instances = mig_instances or _live_instances(nvml)
        self._last_beat = 0.0
        self._active = False
        self.handled = 0

    def activate(self) -> None:
        """Create the spool (root-only) and announce this plugin in `ACTIVE`."""
        self.dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.dir.mkdir(mode=0o700)
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise MockControlError(f"{self.dir} is not a directory owned by uid {os.geteuid()}")
        os.chmod(self.dir, 0o700)
        # Requests left by a previous plugin instance are stale: drop them.
        for entry in os.listdir(self.dir):
            if entry.startswith(("req-", "res-", ".")):
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / entry)
        marker = {"pid": os.getpid(), "node": self._node, "started": time.time()}
        atomic_write(self.dir / ACTIVE_NAME, json.dumps(marker).encode(), mode=0o600)
        self._last_beat = time.monotonic()
        self._active = True
        log.warning("mock control channel active at %s (gpu-dra mock xid|lost|reset)", self.dir)

    def close(self) -> None:
        if self._active:
            self._active = False
            with contextlib.suppress(OSError):
                os.unlink(self.dir / ACTIVE_NAME)

    def poll(self) -> int:
        """Handle every pending request; returns how many were handled."""
        if not self._active:
            return 0
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_SECONDS:
            self._last_beat = now
            try:
                os.utime(self.dir / ACTIVE_NAME)
            except FileNotFoundError:
                log.warning("mock control: %s vanished; recreating it", self.dir / ACTIVE_NAME)
                self.activate()
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            self.activate()
            return 0
        count = 0
        for name in names:
            match = _REQUEST_RE.match(name)
            if match is None:
                continue
            result = self._handle_file(self.dir / name)
            with contextlib.suppress(OSError):
                os.unlink(self.dir / name)
            try:
                atomic_write(
                    self.dir / f"res-{match.group(1)}.json", json.dumps(result).encode(), mode=0o600
                )
            except OSError as err:
                log.error("mock control: cannot answer %s: %s", name, err)
            count += 1
        self.handled += count
        return count

    def _handle_file(self, path: Path) -> dict[str, Any]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise MockControlError("request file is not a regular file owned by root")
                data = os.read(fd, MAX_REQUEST_BYTES + 1)
            finally:
                os.close(fd)
            if len(data) > MAX_REQUEST_BYTES:
                raise MockControlError("request too large")
            request = MockRequest.from_json(data)
            message, instance = self._apply(request)
        except (MockControlError, OSError) as err:
            log.warning("mock control: refused %s: %s", path.name, err)
            return {"ok": False, "message": str(err)}
        log.warning("mock control: injected %s", message)
        answer: dict[str, Any] = {"ok": True, "message": message}
        if instance is not None:
            answer["instance"] = {
                "gpuUUID": instance.gpu_uuid,
                "gpuInstanceId": instance.gi_id,
                "computeInstanceId": instance.ci_id,
                "placement": list(instance.placement),
            }
        return answer

    def resolve(self, device: str) -> str:
        """Device name (`gpu-3`, a partition of it, or a GPU UUID) -> GPU UUID."""
        uuid = self._names.get(device)
        if uuid is None:
            known = sorted(n for n in self._names if n.startswith("gpu-") and "-mig-" not in n)
            raise MockControlError(
                f"unknown device {device!r} on this node (GPUs: {', '.join(known) or 'none'}, "
                "their partitions, or a GPU UUID)"
            )
        return uuid

    def resolve_instance(self, device: str) -> MigInstance:
        """A published MIG device's live GPU instance: the one at the device's
        placement (and of its profile) in the GPU's MIG state right now."""
        uuid = self.resolve(device)
        published = self._devices.get(device)
        placement = device_placement(published) if published is not None else None
        if published is None or placement is None:
            raise MockControlError(
                f"--instance: {device!r} is not a MIG device of this node (name a MIG "
                "partition, or the whole GPU of a GPU in dynamic MIG mode)"
            )
        mig = getattr(published, "mig", None)
        profile_id = getattr(mig, "profile_id", None)
        try:
            instances = list(self._mig_instances(uuid))
        except Exception as err:
            raise MockControlError(
                f"--instance: cannot list the GPU instances of {uuid}: {err}"
            ) from None
        for instance in instances:
            if instance.placement == placement and profile_id in (None, instance.profile_id):
                return instance
        start, size = placement
        raise MockControlError(
            f"--instance: {device} has no GPU instance now (none of its profile at memory "
            f"slices {start}+{size}; a dynamic partition has one only while it is prepared)"
        )

    def apply(self, request: MockRequest) -> str:
        return self._apply(request)[0]

    def _apply(self, request: MockRequest) -> tuple[str, MigInstance | None]:
        request.validate()
        if request.instance:
            assert request.device is not None and request.xid is not None
            instance = self.resolve_instance(request.device)
            self._nvml.inject(
                HealthEvent(
                    instance.gpu_uuid,
                    "xid",
                    xid=request.xid,
                    message=f"Xid {request.xid}",
                    gpu_instance_id=instance.gi_id,
                    compute_instance_id=instance.ci_id,
                )
            )
            ci = "" if instance.ci_id is None else f", compute instance {instance.ci_id}"
            return (
                f"{request.describe()} ({instance.gpu_uuid}, GPU instance {instance.gi_id}{ci})",
                instance,
            )
        if request.all:
            uuids = list(self._uuids)
        else:
            assert request.device is not None
            uuids = [self.resolve(request.device)]
        for uuid in uuids:
            if request.action == "xid":
                event = HealthEvent(uuid, "xid", xid=request.xid, message=f"Xid {request.xid}")
            elif request.action == "lost":
                event = HealthEvent(uuid, "gpu-lost", message="GPU is lost (mock)")
            else:
                event = HealthEvent(uuid, "recovered", message="reset (mock)")
            self._nvml.inject(event)
        return f"{request.describe()} ({', '.join(uuids)})", None


# -- CLI side ------------------------------------------------------------------------


def check_active(state_dir: str | Path, *, now: float | None = None) -> dict[str, Any]:
    """The `ACTIVE` marker of a live plugin consuming the spool, or MockControlError."""
    directory = spool_dir(state_dir)
    marker = directory / ACTIVE_NAME
    try:
        st = os.stat(marker)
        doc = json.loads(marker.read_bytes())
    except FileNotFoundError:
        raise MockControlError(
            f"no kubelet plugin with the mock NVML backend is consuming {directory} "
            f"(no {ACTIVE_NAME} marker). Run this inside the plugin's pod "
            "(kubectl exec), or pass --state-dir with the plugin's data directory"
        ) from None
    except PermissionError:
        raise MockControlError(f"permission denied on {directory}: run as root") from None
    except (OSError, ValueError) as err:
        raise MockControlError(f"cannot read {marker}: {err}") from None
    age = (time.time() if now is None else now) - st.st_mtime
    if age > STALE_AFTER_SECONDS:
        raise MockControlError(
            f"the plugin that owned {directory} (pid {doc.get('pid', '?')}) is not running: "
            f"its {ACTIVE_NAME} marker is {age:.0f}s old"
        )
    return dict(doc) if isinstance(doc, dict) else {}


def submit(state_dir: str | Path, request: MockRequest, *, timeout: float = 5.0) -> str:
    """Deliver `request` to the running plugin and return its answer; raises
    MockControlError when no plugin consumes the spool or the plugin refused it."""
    request.validate()
    marker = check_active(state_dir)
    directory = spool_dir(state_dir)
    ident = f"{time.time_ns():016x}{secrets.token_hex(4)}"
    req = directory / f"req-{ident}.json"
    res = directory / f"res-{ident}.json"
    try:
        atomic_write(req, request.to_json(), mode=0o600)
    except PermissionError:
        raise MockControlError(f"permission denied on {directory}: run as root") from None
    except OSError as err:
        raise MockControlError(f"cannot write {req}: {err}") from None
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = res.read_bytes()
            break
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                os.unlink(req)
            raise MockControlError(
                f"the plugin (pid {marker.get('pid', '?')}) did not answer within "
                f"{timeout:.0f}s; request withdrawn"
            )
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        os.unlink(res)
    try:
        answer = json.loads(data)
    except ValueError as err:
        raise MockControlError(f"unreadable answer from the plugin: {err}") from None
    message = str(answer.get("message", ""))
    if not answer.get("ok"):
        raise MockControlError(f"the plugin refused the request: {message}")
    if request.instance and "instance" not in answer:
        raise MockControlError(
            f"the plugin (pid {marker.get('pid', '?')}) predates --instance: it injected "
            f"the Xid for the whole GPU ({message})"
        )
    return message
