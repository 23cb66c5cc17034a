"""The plugin's /status document, read by `gpu-dra status`, and the metrics drawn from
the same sources: the node at a glance.

The document: the plugin (version, node, driver, start), its registration with the
kubelet, the last ResourceSlice sync, each GPU (name, NVML index, UUID, PCI bus id,
MIG mode, health and failures), the health store, the prepare journal, the MPS
daemons as their last check found them (`driver.state.mps_watch`; None without MPS),
and `problems`: each thing an operator must look at, in one line (empty: healthy);
`notes`: what is not a problem but worth knowing (a GPU whose health events NVML does
not report: its health is unknown, `driver.health.unmonitored`; an NVIDIA Container
Toolkit that gives GPUs to pods without a claim, `driver.plugin.toolkit_config`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from driver.devices.gpu_view import GpuView, MigMode
from driver.health.clear import record_json
from driver.health.failures import HealthDevice
from driver.health.gpu_metrics import tainted_device_names
from driver.health.recovery_taints import RecoveryActions
from driver.health.store import HealthStore
from driver.health.unmonitored import UnmonitoredGpus
from driver.kube.publisher import RESYNC_SECONDS, PublisherStats
from driver.observability import metrics
from driver.plugin.journal_summary import JournalReader, JournalSummary
from driver.plugin.serving_instance import Succession, default_holder
from driver.plugin.toolkit_config import ToolkitCheck
from driver.plugin.transport.registration import RegistrationServicer
from driver.state.journal.checkpoint import Checkpoint
from driver.state.mps_watch import MpsCheck

# A sync older than this means the reconcile keeps failing: it runs at least every
# RESYNC_SECONDS, and at once after every change.
SYNC_STALE_AFTER_SECONDS = 2 * RESYNC_SECONDS


class JournalState(Protocol):
    """What /status needs of `DeviceState`."""

    @property
    def checkpoint_problem(self) -> str | None: ...

    @property
    def checkpoint(self) -> Checkpoint: ...


class MpsDaemons(Protocol):
    """What /status needs of `driver.state.mps_watch.MpsWatch`."""

    def last(self) -> MpsCheck: ...


class SyncStats(Protocol):
    @property
    def stats(self) -> PublisherStats: ...


def export_journal(state: JournalState) -> JournalReader:
    """Make `gpu_dra_prepared_claims` and `gpu_dra_prepared_devices` read the journal
    file at each scrape (NaN while it cannot be read). Returns the reader, for
    `PluginStatus`."""
    reader = JournalReader(state.checkpoint)

    def count(value: int | None) -> float:
        return float("nan") if value is None else float(value)

    metrics.PREPARED_CLAIMS.set_function(lambda: count(reader.summary().prepared_claims))
    metrics.PREPARED_DEVICES.set_function(lambda: count(reader.summary().prepared_devices))
    return reader


def export_gpus(gpus: Sequence[GpuView], version: str) -> None:
    """`gpu_dra_build_info` and `gpu_dra_gpus` by MIG mode (every mode, 0 included)."""
    metrics.BUILD_INFO.labels(version=version).set(1)
    for mode in MigMode:
        metrics.GPUS.labels(mig_mode=mode.value).set(sum(g.mig_mode is mode for g in gpus))


def _rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PluginStatus:
    """The live objects /status reads; `document()` runs once per request."""

    version: str
    node: str
    driver: str
    taint_effect: str
    gpus: Sequence[GpuView]
    devices: Mapping[str, HealthDevice]
    registration: RegistrationServicer
    publisher: SyncStats
    store: HealthStore
    recovery: RecoveryActions
    unmonitored: UnmonitoredGpus
    state: JournalState
    journal: JournalReader
    toolkit: ToolkitCheck | None = None  # None: not checked (mock GPUs)
    mps: MpsDaemons | None = None  # None: no MPS daemons on this node
    succession: Succession | None = None  # None: this instance's place is not reported
    started: float = field(default_factory=time.time)
    clock: Callable[[], float] = time.time

    def _instance(self) -> dict[str, Any] | None:
        """Which instance answers, and whether it serves the node (docs/rolling-updates.md)."""
        if self.succession is None:
            return None
        place = self.succession.place
        return {
            "holder": default_holder() if place is None else place.holder,
            "place": None if place is None else place.number,
            "serving": self.succession.serving(),
        }

    def document(self) -> dict[str, Any]:
        now = self.clock()
        registered = self.registration.registered.is_set()
        refusal = None if registered else self.registration.last_error or None
        slices = self._slices(now)
        gpus = [self._gpu(gpu) for gpu in self.gpus]
        journal = self.journal.summary()
        mps = None if self.mps is None else self.mps.last()
        problems = self._problems(registered, refusal, slices, gpus, journal)
        problems += [] if mps is None else mps.problems()
        return {
            "plugin": {
                "version": self.version,
                "node": self.node,
                "driver": self.driver,
                "pid": os.getpid(),
                "startedAt": _rfc3339(self.started),
                "uptimeSeconds": round(now - self.started),
                "instance": self._instance(),
            },
            "registration": {"registered": registered, "error": refusal},
            "slices": slices,
            "gpus": gpus,
            "health": {
                "taintEffect": self.taint_effect,
                "storeProblem": self.store.problem,
                "failedGPUs": sum(g["health"] != "healthy" for g in gpus),
                "taintedDevices": len(
                    tainted_device_names(self.store, list(self.devices.values()), self.recovery)
                ),
                "taints": self._taint_counts(),
                "unmonitoredGPUs": sum(not g["monitored"] for g in gpus),
            },
            "journal": {**journal.to_json(), "prepareRefused": self.state.checkpoint_problem},
            "nvidiaToolkit": None if self.toolkit is None else self.toolkit.to_json(),
            "mps": None if mps is None else mps.to_json(),
            "problems": problems,
            "notes": self._notes(gpus),
            "healthy": not problems,
        }

    def _notes(self, gpus: list[dict[str, Any]]) -> list[str]:
        notes = [
            f"{g['name']} ({g['uuid']}) is not monitored: {g['unmonitoredReason']}; its "
            "failures go unseen"
            for g in gpus
            if not g["monitored"]
        ]
        if self.toolkit is not None and self.toolkit.warning is not None:
            notes.append(self.toolkit.warning)
        return notes

    def _slices(self, now: float) -> dict[str, Any]:
        stats = self.publisher.stats
        synced = stats.last_synced or None
        age = None if synced is None else round(now - synced, 1)
        return {
            "lastSynced": None if synced is None else _rfc3339(synced),
            "ageSeconds": age,
            "stale": age is None or age > SYNC_STALE_AFTER_SECONDS,
            "publishedDevices": len(self.devices),
            "lastError": stats.failing,  # None once a publish after it succeeded
        }

    def _taint_counts(self) -> list[dict[str, Any]]:
        """Each health taint the plugin publishes, with its own effect (a failure's is
        --xid-taint-effect, a recovery action's the action's) and on how many devices."""
        taints = self.recovery.add_taints(
            self.store.device_taints(self.devices, driver=self.driver, effect=self.taint_effect)
        )
        counts = Counter(
            (taint["key"], taint.get("value"), taint["effect"])
            for listed in taints.values()
            for taint in listed
        )
        return [
            {"key": key, "value": value, "effect": effect, "devices": n}
            for (key, value, effect), n in sorted(
                counts.items(), key=lambda i: (i[0][0], str(i[0][1]))
            )
        ]

    def _gpu(self, gpu: GpuView) -> dict[str, Any]:
        """The GPU with its failures: what the health store recorded (on it or its
        GPU instances) and a recovery action that taints it, as gpu_dra_gpu_healthy
        and the kubelet's health stream count them."""
        records = [self.store.gpu_failure(gpu.uuid)]
        records += [f for _, f in sorted(self.store.failed_instances().get(gpu.uuid, {}).items())]
        failures = [record_json(gpu.uuid, f) for f in records if f is not None]
        recovery = self.recovery.tainting(gpu.uuid)
        if recovery is not None:
            failures.append(recovery.to_json(self.driver))
        health = (
            "unknown" if self.store.problem is not None else "failed" if failures else "healthy"
        )
        own = [d for d in self.devices.values() if d.gpu_uuid == gpu.uuid]
        unmonitored = self.unmonitored.reasons().get(gpu.uuid)
        return {
            **gpu.to_json(),
            "health": health,
            "failures": failures,
            "taintedDevices": len(tainted_device_names(self.store, own, self.recovery)),
            "monitored": unmonitored is None,
            "unmonitoredReason": unmonitored,
        }

    def _problems(
        self,
        registered: bool,
        refusal: str | None,
        slices: dict[str, Any],
        gpus: list[dict[str, Any]],
        journal: JournalSummary,
    ) -> list[str]:
        problems = []
        if refusal is not None:
            problems.append(f"the kubelet refused the registration: {refusal}")
        elif not registered:
            problems.append("the kubelet has not registered the plugin (yet)")
        if slices["lastSynced"] is None:
            problems.append("ResourceSlices not published yet")
        elif slices["stale"]:
            failing = f" (last error: {slices['lastError']})" if slices["lastError"] else ""
            problems.append(
                f"ResourceSlices last published {slices['ageSeconds']:.0f}s ago{failing}"
            )
        if self.store.problem is not None:
            problems.append(f"health store corrupt, every GPU kept failed: {self.store.problem}")
        for gpu in gpus:
            for failure in gpu["failures"]:
                problems.append(f"{gpu['name']} ({gpu['uuid']}) failed: {failure['message']}")
        if journal.status in ("corrupt", "unreadable"):
            problems.append(f"prepare journal {journal.status}: {journal.problem}")
        elif self.state.checkpoint_problem is not None:
            problems.append(f"prepare refused: {self.state.checkpoint_problem}")
        return problems
