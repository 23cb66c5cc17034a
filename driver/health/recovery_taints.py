"""Health by what the GPU needs: NVML's recovery action, polled, as a device taint that
goes by itself once the GPU is fine again (docs/health.md, "Recovery actions": the table
of actions, their taints and what an operator does).

The health monitor thread reads every GPU's recovery action (`driver.nvml.recovery_action`,
through `NvmlBackend.recovery_actions`) at start, then every
`--recovery-action-poll-interval` seconds. A GPU whose action is not NONE gets the taint
`<driver>/recovery-action=<action>` on every device of it (a reset or a reboot takes the
whole GPU), with the effect `POLICIES` gives: drain actions evict (NoExecute), since the
GPU cannot recover while its work runs; reset and reboot actions keep new pods off
(NoSchedule) and leave the disruptive step to the operator; an IMEX-domain recovery is
not the GPU's and is only logged. The taint goes at the first read that answers NONE (the
GPU answered NVML and needs nothing); a read that fails (the GPU is lost, an NVML error)
keeps it.

These records are separate from the health store's: the poll only ever removes its own
taint, and `gpu-dra health clear` does not remove it (the next read would put it back).
They are kept in memory only: NVML keeps the action across a plugin restart, and the
first read after the start publishes it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.devices.formatting import taint_text
from driver.errors import transient
from driver.health.clear import Publisher
from driver.health.failures import Devices, device_list, now_rfc3339, time_added
from driver.health.node_events import REASON_CLEARED, REASON_TAINTED, device_names_text
from driver.kube.kube_events import NodeEvent
from driver.nvml.recovery_action import ACTION_NONE, RecoveryReading, action_name
from driver.state.request import DeviceHealth

log = logging.getLogger(__name__)

KIND_RECOVERY_ACTION = "recovery-action"
DEFAULT_POLL_SECONDS = 5
SYNC_TIMEOUT = 10.0  # how long prepare waits for the API server to accept a taint

Taints = Mapping[str, Sequence[Mapping[str, str]]]  # device name -> its taints


@dataclass(frozen=True)
class ActionPolicy:
    """What one recovery action means for scheduling, and what an operator does."""

    effect: str | None  # the taint's effect; None: no taint, the action is only logged
    todo: str


_RESET = "reset it (nvidia-smi --gpu-reset -i <bus id>) or reboot the node"
POLICIES: Mapping[int, ActionPolicy] = {
    1: ActionPolicy("NoSchedule", f"the GPU needs a reset: once no pod uses it, {_RESET}"),
    2: ActionPolicy("NoSchedule", "the node needs a reboot: drain it (kubectl drain) and reboot"),
    3: ActionPolicy(
        "NoExecute", "peer-to-peer (NVLink) traffic must drain: the GPU's pods are evicted"
    ),
    4: ActionPolicy(
        "NoExecute", f"the GPU must be drained and reset: its pods are evicted; then {_RESET}"
    ),
    5: ActionPolicy(
        None, "the IMEX domain needs recovery (its IMEX daemons); the GPU itself stays usable"
    ),
    6: ActionPolicy(
        "NoSchedule",
        "the GPU's PCIe bus needs a reset: once no pod uses the GPU, reset the bus or "
        "reboot the node",
    ),
    7: ActionPolicy(
        "NoSchedule", "the system needs a reboot: drain the node (kubectl drain) and reboot"
    ),
}
UNKNOWN_POLICY = ActionPolicy(
    "NoSchedule", "an action this driver does not know: see NVIDIA's documentation of it"
)


@dataclass(frozen=True)
class RecoveryFailure:
    """A GPU whose recovery action is not NONE."""

    gpu_uuid: str
    action: int
    since: str  # RFC 3339, UTC: when this action was first read

    @property
    def name(self) -> str:
        return action_name(self.action)

    @property
    def policy(self) -> ActionPolicy:
        return POLICIES.get(self.action, UNKNOWN_POLICY)

    @property
    def effect(self) -> str | None:
        return self.policy.effect

    def reason(self) -> str:
        return f"NVML recovery action {self.name}: {self.policy.todo}"

    def message(self) -> str:
        return f"{self.reason()} (since {self.since})"

    def to_json(self, driver: str) -> dict[str, Any]:
        """As /status lists a GPU's failures (`driver.health.clear.record_json`'s keys,
        with the taint's effect: the action's own, not --xid-taint-effect)."""
        return {
            "gpuUUID": self.gpu_uuid,
            "placement": None,
            "gpuInstanceId": None,
            "computeInstanceId": None,
            "key": f"{driver}/{KIND_RECOVERY_ACTION}",
            "value": self.name,
            "effect": self.effect,
            "reason": self.reason(),
            "since": self.since,
            "message": self.message(),
        }

    def taint(self, driver: str) -> dict[str, str] | None:
        if self.effect is None:
            return None
        return {
            "key": f"{driver}/{KIND_RECOVERY_ACTION}",
            "value": self.name,
            "effect": self.effect,
        } | time_added(self.since)


@dataclass(frozen=True)
class RecoveryChange:
    """One GPU's recovery action appeared, changed (both set) or went."""

    gpu_uuid: str
    added: RecoveryFailure | None
    removed: RecoveryFailure | None


class RecoveryActions:
    """The GPUs of the published devices whose recovery action is not NONE, and the
    taints that follows. Written by the health monitor's thread, read by the slice
    publisher and prepare."""

    def __init__(self, devices: Devices, *, driver: str) -> None:
        self.driver = driver
        self._gpu_of = {d.name: d.gpu_uuid for d in device_list(devices)}
        self.gpu_uuids: tuple[str, ...] = tuple(dict.fromkeys(self._gpu_of.values()))
        self._lock = threading.Lock()
        self._failures: dict[str, RecoveryFailure] = {}
        self._unanswered: dict[str, str] = {}  # GPU UUID -> why its last read failed
        self._unsupported: set[str] = set()

    def apply(self, reading: RecoveryReading) -> RecoveryChange | None:
        """One GPU's reading; the change when its action appeared, changed or went."""
        uuid = reading.gpu_uuid
        if reading.action is None:
            if not reading.supported:
                if uuid not in self._unsupported:
                    self._unsupported.add(uuid)
                    log.info(
                        "GPU %s: NVML reports no recovery action (%s; driver R565 or later "
                        "has it): only its events decide its health",
                        uuid,
                        reading.error or "not supported",
                    )
            elif self._unanswered.get(uuid) != reading.error:
                self._unanswered[uuid] = reading.error
                kept = self.failure(uuid)
                log.warning(
                    "GPU %s: cannot read its recovery action (%s)%s",
                    uuid,
                    reading.error,
                    f"; its {kept.name} taint stays" if kept is not None else "",
                )
            return None
        if self._unanswered.pop(uuid, None) is not None:
            log.info("GPU %s: NVML answers its recovery action again", uuid)
        with self._lock:
            removed = self._failures.get(uuid)
            if reading.action == ACTION_NONE:
                added = None
                self._failures.pop(uuid, None)
            elif removed is not None and removed.action == reading.action:
                return None
            else:
                added = self._failures[uuid] = RecoveryFailure(uuid, reading.action, now_rfc3339())
        if added is not None:
            taint = added.taint(self.driver)
            shown = taint_text(taint) if taint is not None else "no taint"
            log.warning("GPU %s: %s (%s)", uuid, added.reason(), shown)
        elif removed is not None:
            log.warning(
                "GPU %s answers NVML with no recovery action: its %s taint is removed",
                uuid,
                removed.name,
            )
        else:
            return None
        return RecoveryChange(uuid, added, removed)

    def failure(self, gpu_uuid: str) -> RecoveryFailure | None:
        with self._lock:
            return self._failures.get(gpu_uuid)

    def failures(self) -> dict[str, RecoveryFailure]:
        """By GPU UUID."""
        with self._lock:
            return dict(self._failures)

    def device_names(self, gpu_uuid: str) -> list[str]:
        """The published devices of the GPU, in published order."""
        return [name for name, uuid in self._gpu_of.items() if uuid == gpu_uuid]

    def tainting(self, gpu_uuid: str) -> RecoveryFailure | None:
        """The GPU's recovery action if it taints the GPU's devices (not one that is
        only logged): the GPU is unhealthy while there is one."""
        failure = self.failure(gpu_uuid)
        return failure if failure is not None and failure.effect is not None else None

    def device_failure(self, device_name: str) -> RecoveryFailure | None:
        """The recovery action that taints this device (not one that is only logged)."""
        uuid = self._gpu_of.get(device_name)
        return self.tainting(uuid) if uuid is not None else None

    def add_taints(self, taints: Taints) -> dict[str, list[dict[str, str]]]:
        """`taints` (the health store's, by device name) with the recovery-action
        taint added to every device of a GPU that needs one."""
        merged = {name: [dict(t) for t in listed] for name, listed in taints.items()}
        failures = self.failures()
        for name, uuid in self._gpu_of.items():
            failure = failures.get(uuid)
            taint = failure.taint(self.driver) if failure is not None else None
            if taint is not None:
                merged.setdefault(name, []).append(taint)
        return merged


class RecoveryPoller:
    """The health monitor's poller (`HealthMonitor(pollers=...)`): called on every
    event wait, it reads the recovery actions once per `interval` seconds and
    republishes when a taint changed; `on_change` hears of each change after that
    (the health monitor: metrics, Node events, the kubelet's health stream)."""

    def __init__(
        self,
        read: Callable[[Sequence[str]], Sequence[RecoveryReading]],
        actions: RecoveryActions,
        publisher: Publisher | None,
        *,
        interval: float = DEFAULT_POLL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[RecoveryChange], object] | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"recovery action poll interval must be > 0, got {interval}")
        self._read = read
        self._actions = actions
        self._publisher = publisher
        self._interval = interval
        self._clock = clock
        self._on_change = on_change
        self._due: float | None = None  # None: read at the first call
        self._error: str | None = None

    def __call__(self) -> None:
        now = self._clock()
        if self._due is None:
            log.info(
                "reading the NVML recovery action of %d GPU(s) every %gs",
                len(self._actions.gpu_uuids),
                self._interval,
            )
        elif now < self._due:
            return
        self._due = now + self._interval
        try:
            readings = self._read(self._actions.gpu_uuids)
        except Exception as err:
            if str(err) != self._error:
                log.warning("cannot read the GPUs' recovery actions: %s; retrying", err)
            self._error = str(err)
            return
        self._error = None
        changes = [c for c in map(self._actions.apply, readings) if c is not None]
        if changes and self._publisher is not None:
            self._publisher.trigger()
        if self._on_change is not None:
            for change in changes:
                self._on_change(change)


class RecoveryAwareHealth:
    """`DeviceHealth` for prepare: a device whose GPU carries a recovery-action taint
    is refused like a failed one (and its taint published first); any other device
    is `inner`'s to answer."""

    def __init__(self, inner: DeviceHealth, actions: RecoveryActions, publisher: Publisher) -> None:
        self._inner = inner
        self._actions = actions
        self._publisher = publisher

    def failure(self, device_name: str) -> str | None:
        failure = self._actions.device_failure(device_name)
        if failure is not None:
            return failure.message()
        return self._inner.failure(device_name)

    def ensure_tainted(self, device_name: str) -> None:
        if self._actions.device_failure(device_name) is None:
            self._inner.ensure_tainted(device_name)
        elif not self._publisher.wait_synced(self._publisher.trigger(), SYNC_TIMEOUT):
            raise transient(
                f"device {device_name}: the API server has not accepted its recovery-action "
                f"taint within {SYNC_TIMEOUT:.0f}s; retrying"
            )


def recovery_event(
    change: RecoveryChange, devices: Sequence[str], *, gpu: str, driver: str
) -> NodeEvent | None:
    """The Node event for a change of one GPU's recovery-action taint (`gpu`: its name
    and UUID as shown): `GpuTainted` when a taint appears or changes, `GpuTaintCleared`
    when it goes; None for an action that is only logged."""
    added, removed = change.added, change.removed
    shown = f"{len(devices)} device(s): {device_names_text(devices)}"
    if added is not None and (taint := added.taint(driver)) is not None:
        return NodeEvent(
            REASON_TAINTED,
            f"{gpu}: {added.reason()}; taint {taint_text(taint)} on {shown}",
            "Warning",
        )
    if removed is not None and removed.effect is not None:
        now = added.reason() if added else "NVML answers no recovery action"
        return NodeEvent(
            REASON_CLEARED,
            f"{gpu}: {now}; taint removed from {shown} (was: {removed.reason()})",
            "Normal",
        )
    return None
