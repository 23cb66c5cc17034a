"""`clear`, a control request (`driver.health.control_queue`): an operator repaired a GPU or a
MIG partition (docs/day-2.md, "`gpu-dra health clear DEVICE`").

The running plugin applies it itself: the CLI never writes the health store behind the
plugin's back. Accepted with every NVML backend: it only forgets failures, it injects nothing.

Request (`POST /control/clear`): `{"device": "<name or GPU UUID>", "dryRun": bool,
"expect": [<record>...] | null}`. The whole GPU (`gpu-<n>`, its UUID) forgets its failure
and those of all its GPU instances, as NVML's recovery event does; a partition, the
GPU-instance failures on its memory slices (refused when its GPU itself failed: that
failure covers every device of the GPU; or when it is not a MIG device: its failures are
the GPU's). `dryRun`: nothing changes, the answer lists what would go. `expect`: the
records a preview showed; the clear is refused when they changed meanwhile (a new Xid).

A clear forgets only the health store's failures: a taint of NVML's recovery action
(`driver.health.recovery_taints`) stays on every device of the GPU until NVML reports no
action; the plan names it (`keptTaint`). After a clear the slices are republished and the
answer says whether the API server accepted them (`published`) within `PUBLISH_TIMEOUT`.
With `taint_events`, a clear that removes a taint is also a `GpuTaintCleared` Node Event.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from driver.health.control_queue import ControlError, ControlQueue
from driver.health.failures import (
    Devices,
    GpuFailure,
    HealthDevice,
    Placement,
    device_list,
    device_placement,
    overlaps,
)
from driver.health.gpu_metrics import published_gpu_names
from driver.health.node_events import RecoveryTaints, TaintEvents, kept_taint
from driver.health.store import HealthStore
from driver.observability import metrics

log = logging.getLogger(__name__)

ACTION = "clear"
OPERATOR_CAUSE = "cleared by an operator (gpu-dra health clear)"
PUBLISH_TIMEOUT = 5.0  # seconds a clear waits for the API server to accept its slices


class Publisher(Protocol):
    """What health needs of `SlicePublisher`."""

    def trigger(self) -> int: ...
    def wait_synced(self, ticket: int, timeout: float) -> bool: ...


def record_json(gpu_uuid: str, failure: GpuFailure) -> dict[str, Any]:
    """A failure as the answer (and `expect`) carries it."""
    return {
        "gpuUUID": gpu_uuid,
        "placement": None if failure.placement is None else list(failure.placement),
        "gpuInstanceId": failure.gpu_instance_id,
        "computeInstanceId": failure.compute_instance_id,
        "key": failure.key,
        "value": failure.value,
        "reason": failure.reason,
        "since": failure.since,
        "message": failure.message(),
    }


@dataclass(frozen=True)
class ClearPlan:
    """What a clear of one target removes and which devices it leaves untainted."""

    target: str
    gpu_uuid: str
    placement: Placement | None  # None: the whole GPU
    records: tuple[GpuFailure, ...]
    untainted: tuple[str, ...]  # devices whose taint goes
    still_tainted: tuple[str, ...]  # devices of the GPU that keep a taint
    kept_taint: str | None  # `kept_taint`: NVML's, on every device of the GPU
    gpu_devices: int  # how many devices the GPU has

    def records_json(self) -> list[dict[str, Any]]:
        return [record_json(self.gpu_uuid, f) for f in self.records]

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "gpuUUID": self.gpu_uuid,
            "scope": "gpu" if self.placement is None else "instance",
            "placement": None if self.placement is None else list(self.placement),
            "records": self.records_json(),
            "untaintedDevices": list(self.untainted),
            "stillTaintedDevices": list(self.still_tainted),
            "keptTaint": self.kept_taint,
            "gpuDevices": self.gpu_devices,
        }


class ClearAction:
    """Handles `clear` in the plugin (the health monitor's thread: the only writer of
    the store, so nothing changes between the plan and the clear)."""

    def __init__(
        self,
        store: HealthStore,
        devices: Devices,
        publisher: Publisher | None,
        *,
        on_change: Callable[[], None] = lambda: None,
        taint_events: TaintEvents | None = None,
        recovery: RecoveryTaints | None = None,
    ) -> None:
        self._store = store
        self._recovery = recovery
        self._devices = device_list(devices)
        self._by_name: dict[str, HealthDevice] = {d.name: d for d in self._devices}
        self._gpu_names = published_gpu_names(self._devices)
        self._publisher = publisher
        self._on_change = on_change
        self._taint_events = taint_events

    def register_on(self, control: ControlQueue) -> None:
        control.register(ACTION, self.handle)

    def handle(self, doc: dict[str, Any]) -> dict[str, Any]:
        device, dry_run, expect = doc.get("device"), doc.get("dryRun", False), doc.get("expect")
        if not isinstance(device, str) or not device:
            raise ControlError("clear: device must be a non-empty string")
        if not isinstance(dry_run, bool):
            raise ControlError("clear: dryRun must be a boolean")
        if expect is not None and not (
            isinstance(expect, list) and all(isinstance(r, dict) for r in expect)
        ):
            raise ControlError("clear: expect must be a list of records or null")
        plan = self.plan(device)
        if expect is not None and expect != plan.records_json():
            raise ControlError(
                f"the recorded failures of {plan.target} changed since the preview "
                f"(now: {_describe(plan.records)}); run the command again"
            )
        if dry_run or not plan.records:
            return {"message": _preview(plan), "dryRun": dry_run, "plan": plan.to_json()}
        with (
            contextlib.nullcontext()
            if self._taint_events is None
            else self._taint_events.change(plan.gpu_uuid, OPERATOR_CAUSE)
        ):
            if plan.placement is None:
                self._store.clear(plan.gpu_uuid)
            else:
                self._store.clear_instances(plan.gpu_uuid, plan.placement)
        metrics.XID_EVENTS.labels(xid="operator-clear", verdict="cleared").inc()
        log.warning(
            "operator cleared %s (%s): %s; untainted: %s",
            plan.target,
            plan.gpu_uuid,
            _describe(plan.records),
            ", ".join(plan.untainted) or "none",
        )
        self._on_change()
        # Whether the API server accepted slices built after the clear.
        published = None
        if self._publisher is not None:
            ticket = self._publisher.trigger()
            published = self._publisher.wait_synced(ticket, PUBLISH_TIMEOUT)
        return {
            "message": f"cleared {plan.target}: {_describe(plan.records)}",
            "dryRun": False,
            "plan": plan.to_json(),
            "published": published,
        }

    def plan(self, target: str) -> ClearPlan:
        gpu_uuid, placement = self._resolve(target)
        gpu_failure = self._store.gpu_failure(gpu_uuid)
        instances = sorted(self._store.failed_instances().get(gpu_uuid, {}).items())
        if placement is None:
            records = ([gpu_failure] if gpu_failure else []) + [f for _, f in instances]
        elif gpu_failure is not None:
            raise ControlError(
                f"{target} is unhealthy because its whole GPU failed "
                f"({gpu_failure.message()}): clear {self._gpu_names.get(gpu_uuid, gpu_uuid)} "
                "instead (the GPU and all its devices)"
            )
        else:
            records = [f for where, f in instances if overlaps(placement, where)]
        remaining = [where for where, f in instances if f not in records]
        gpu_devices = [d for d in self._devices if d.gpu_uuid == gpu_uuid]
        tainted = self._store.device_failures(gpu_devices)
        # A tainted device keeps its taint while a GPU instance the clear leaves covers it.
        still = [
            d.name
            for d in gpu_devices
            if d.name in tainted and any(overlaps(device_placement(d), p) for p in remaining)
        ]
        untainted = [d.name for d in gpu_devices if d.name in tainted and d.name not in still]
        return ClearPlan(
            target,
            gpu_uuid,
            placement,
            tuple(records),
            tuple(untainted),
            tuple(still),
            kept_taint(self._recovery, gpu_uuid),
            len(gpu_devices),
        )

    def _resolve(self, target: str) -> tuple[str, Placement | None]:
        """(GPU UUID, placement of the partition or None for the whole GPU)."""
        device = self._by_name.get(target)
        if device is None:
            known_uuids = {d.gpu_uuid for d in self._devices} | set(self._store.failed_gpus())
            known_uuids |= set(self._store.failed_instances())
            if target in known_uuids:
                return target, None
            gpus = ", ".join(sorted(self._gpu_names.values(), key=lambda n: (len(n), n)))
            raise ControlError(
                f"unknown device {target!r} on this node (GPUs: {gpus or 'none'}, "
                "their partitions, or a GPU UUID)"
            )
        if not getattr(device, "is_partition", False):
            return device.gpu_uuid, None
        placement = device_placement(device)
        if placement is None:
            failure = self._store.gpu_failure(device.gpu_uuid)
            why = f" ({failure.message()})" if failure is not None else ""
            raise ControlError(
                f"{target} is not a MIG device: only its GPU can fail{why}; clear "
                f"{self._gpu_names.get(device.gpu_uuid, device.gpu_uuid)} instead"
            )
        return device.gpu_uuid, placement


def _describe(records: tuple[GpuFailure, ...]) -> str:
    return "; ".join(f.message() for f in records) or "no recorded failure"


def _preview(plan: ClearPlan) -> str:
    if not plan.records:
        kept = (
            f"; its devices keep {plan.kept_taint} until NVML reports no recovery action"
            if plan.kept_taint
            else ""
        )
        return f"{plan.target} has no recorded failure: nothing to clear{kept}"
    return f"would clear {plan.target}: {_describe(plan.records)}"
