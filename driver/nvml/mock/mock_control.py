"""The mock NVML's control actions: `gpu-dra mock xid|lost|reset|recovery-action`, and
`process` (a compute process started on a mock GPU, or ended).

Offered only by a plugin on the mock backend (`MockBackend.control_actions`, which the
plugin registers on its control requests, `driver.health.control_queue`): they arrive as
`POST /control/<action>` on its status socket. A plugin on real NVML answers 404 (it
does not accept them).

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
- `recovery-action` sets the GPU's NVML recovery action (`"recoveryAction"`: the
  number, `driver.nvml.recovery_action`), the field the plugin polls
  (`driver.health.recovery_taints`).
- `process` starts a process on a GPU as NVML would list it
  (`driver/nvml/mock/mock_processes.py`): `{"device": <name>, "kind": "compute" |
  "mps-client", "memoryMiB": <n>, "podUID": <uid>}` (kind `compute`, a process
  outside MPS, 1024 MiB and no pod by default; with a pod UID the mock writes the
  process's cgroup where the plugin looks for it), answered with its `pid`; `{"end":
  <pid>}` ends one. No CUDA process runs on a mock GPU: this is how a test or a demo
  shows the plugin one (docs/mps.md, "Escapes"). A process the GPU's compute mode
  refuses is refused as CUDA refuses it ("all CUDA-capable devices are busy or
  unavailable": a `compute` process on a GPU in EXCLUSIVE_PROCESS that another
  process holds, e.g. the MPS server of a strict claim; its `mps-client` is accepted).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from driver.health.control_queue import ControlError, Handler
from driver.health.failures import Devices, HealthDevice, device_list, device_placement
from driver.nvml.discovered import HealthEvent, MigInstance
from driver.nvml.mock.mock_compute_mode import DevicesUnavailable
from driver.nvml.recovery_action import MAX_ACTION, action_name

log = logging.getLogger(__name__)

RECOVERY_ACTION = "recovery-action"
PROCESS = "process"
ACTIONS = ("xid", "lost", "reset", RECOVERY_ACTION)
PROCESS_KINDS = ("compute", "mps-client")
MAX_PROCESS_MIB = 1 << 24
_POD_UID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

_DEVICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


MockControlError = ControlError


@dataclass(frozen=True)
class MockRequest:
    action: str  # "xid" | "lost" | "reset" | "recovery-action"
    device: str | None = None
    xid: int | None = None
    all: bool = False
    instance: bool = False  # xid only: attribute it to the device's live GPU instance
    recovery_action: int | None = None  # recovery-action only: NVML's value to set

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
        if self.action == RECOVERY_ACTION:
            if self.recovery_action is None or not 0 <= self.recovery_action <= MAX_ACTION:
                raise MockControlError(
                    f"invalid recovery action {self.recovery_action!r} (0..{MAX_ACTION})"
                )
        elif self.recovery_action is not None:
            raise MockControlError(
                f"a recovery action is only valid for {RECOVERY_ACTION}, not {self.action}"
            )

    def to_json(self) -> bytes:
        return json.dumps(self.to_document()).encode()

    def to_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "action": self.action,
            "device": self.device,
            "xid": self.xid,
            "all": self.all,
        }
        if self.instance:
            doc["instance"] = True
        if self.recovery_action is not None:
            doc["recoveryAction"] = self.recovery_action
        return doc

    @classmethod
    def from_json(cls, data: bytes) -> MockRequest:
        try:
            doc = json.loads(data)
        except ValueError as err:
            raise MockControlError(f"malformed request: {err}") from None
        return cls.from_document(doc)

    @classmethod
    def from_document(cls, doc: object) -> MockRequest:
        try:
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            request = cls(
                action=str(doc["action"]),
                device=None if doc.get("device") is None else str(doc["device"]),
                xid=None if doc.get("xid") is None else int(doc["xid"]),
                all=bool(doc.get("all", False)),
                instance=bool(doc.get("instance", False)),
                recovery_action=_optional_int(doc.get("recoveryAction")),
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
        if self.action == RECOVERY_ACTION:
            assert self.recovery_action is not None
            return f"recovery action {action_name(self.recovery_action)} on {target}"
        return f"reset of {target}"


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}")
    return value


class _MockGpu(Protocol):
    @property
    def uuid(self) -> str: ...
    @property
    def minor(self) -> int: ...


class InjectableNvml(Protocol):
    """What the mock's control actions need of `MockNvml`."""

    @property
    def gpus(self) -> list[Any]: ...

    def inject(self, event: HealthEvent) -> None: ...

    def set_recovery_action(self, uuid: str, action: int) -> None: ...

    def start_process(
        self,
        gpu_uuid: str,
        kind: str = "compute",
        *,
        used_bytes: int = 1 << 30,
        name: str | None = None,
        pod_uid: str | None = None,
    ) -> Any: ...

    def end_process(self, pid: int) -> Any: ...


MigInstances = Callable[[str], Iterable[MigInstance]]  # GPU UUID -> live GPU instances


def _live_instances(nvml: InjectableNvml) -> MigInstances:
    from driver.nvml.mig.mig_manager import MigManager

    def instances(gpu_uuid: str) -> Iterable[MigInstance]:
        return MigManager(nvml).instances(gpu_uuid)

    return instances


class MockActions:
    """`xid`, `lost`, `reset`, `recovery-action` on a mock NVML: `handlers()`, to
    register on the plugin's control requests."""

    def __init__(
        self,
        nvml: InjectableNvml,
        devices: Devices = (),
        *,
        mig_instances: MigInstances | None = None,
    ) -> None:
        self._nvml = nvml
        gpus: list[_MockGpu] = list(nvml.gpus)
        self._uuids = [g.uuid for g in gpus]
        self._names: dict[str, str] = {f"gpu-{g.minor}": g.uuid for g in gpus}
        self._names.update({g.uuid: g.uuid for g in gpus})
        self._devices: dict[str, HealthDevice] = {d.name: d for d in device_list(devices)}
        self._names.update({name: d.gpu_uuid for name, d in self._devices.items()})
        self._mig_instances = mig_instances or _live_instances(nvml)

    def handlers(self) -> dict[str, Handler]:
        log.warning("mock control: gpu-dra mock %s accepted", "|".join((*ACTIONS, PROCESS)))
        handlers: dict[str, Handler] = dict.fromkeys(ACTIONS, self.handle)
        handlers[PROCESS] = self.handle_process
        return handlers

    def handle_process(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`process`: start a mock process on a GPU, or end one (`{"end": <pid>}`)."""
        doc = {k: v for k, v in doc.items() if k != "action"}  # the status socket names it
        if "end" in doc:
            if set(doc) != {"end"}:
                raise MockControlError("give either end or a process to start, not both")
            pid = _optional_int(doc["end"]) if not isinstance(doc["end"], str) else None
            if pid is None:
                raise MockControlError(f"invalid pid {doc['end']!r}")
            try:
                ended = self._nvml.end_process(pid)
            except KeyError:
                raise MockControlError(f"no mock process {pid}") from None
            message = f"ended {ended.kind} process {pid}"
            log.warning("mock control: %s", message)
            return {"message": message, "pid": pid}
        unknown = set(doc) - {"device", "kind", "memoryMiB", "podUID"}
        if unknown:
            raise MockControlError(f"unknown field(s): {', '.join(sorted(unknown))}")
        device = doc.get("device")
        if not isinstance(device, str) or not _DEVICE_RE.match(device):
            raise MockControlError(f"invalid device name {device!r}")
        kind = doc.get("kind", "compute")
        if kind not in PROCESS_KINDS:
            raise MockControlError(f"invalid kind {kind!r} (one of {', '.join(PROCESS_KINDS)})")
        try:
            mib = _optional_int(doc.get("memoryMiB"))
        except TypeError:
            mib = -1
        mib = 1024 if mib is None else mib
        if not 0 <= mib <= MAX_PROCESS_MIB:
            raise MockControlError(f"invalid memoryMiB {doc.get('memoryMiB')!r}")
        pod = doc.get("podUID")
        if pod is not None and (not isinstance(pod, str) or not _POD_UID_RE.match(pod)):
            raise MockControlError(f"invalid podUID {pod!r} (a pod's metadata.uid)")
        uuid = self.resolve(device)
        try:
            process = self._nvml.start_process(uuid, kind, used_bytes=mib << 20, pod_uid=pod)
        except DevicesUnavailable as err:  # the GPU's compute mode refuses its context
            raise MockControlError(f"{kind} process on {device}: {err}") from None
        where = f" in pod {pod}" if pod else ""
        message = f"started {kind} process {process.pid} on {device} ({uuid}){where}"
        log.warning("mock control: %s", message)
        return {"message": message, "pid": process.pid}

    def handle(self, doc: dict[str, Any]) -> dict[str, Any]:
        """One control request: inject it, answer what was injected."""
        request = MockRequest.from_document(doc)
        message, instance = self._apply(request)
        log.warning("mock control: injected %s", message)
        answer: dict[str, Any] = {"message": message}
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
            if request.action == RECOVERY_ACTION:
                assert request.recovery_action is not None
                self._nvml.set_recovery_action(uuid, request.recovery_action)
                continue
            if request.action == "xid":
                event = HealthEvent(uuid, "xid", xid=request.xid, message=f"Xid {request.xid}")
            elif request.action == "lost":
                event = HealthEvent(uuid, "gpu-lost", message="GPU is lost (mock)")
            else:
                event = HealthEvent(uuid, "recovered", message="reset (mock)")
            self._nvml.inject(event)
        return f"{request.describe()} ({', '.join(uuids)})", None
