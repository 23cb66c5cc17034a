"""The per-GPU health metrics (`gpu_dra_gpu_healthy`, `gpu_dra_gpu_xid_events_total`),
labelled with each GPU's UUID and name, every series present from the start. A GPU is
unhealthy with a recorded failure or a recovery action that taints it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from driver.health.failures import HealthDevice
from driver.health.store import HealthStore
from driver.observability import metrics

UNKNOWN_GPU = "unknown"  # the device label of a GPU discovery did not name


class RecoveryTaints(Protocol):
    """What the metrics need of `driver.health.recovery_taints.RecoveryActions`."""

    def device_failure(self, device_name: str) -> object | None: ...


@dataclass(frozen=True)
class WholeGpu:
    """A GPU as the health store sees its whole-GPU device (`HealthDevice`): every
    failure of it or of its GPU instances covers it."""

    name: str
    gpu_uuid: str


def published_gpu_names(devices: Iterable[HealthDevice]) -> dict[str, str]:
    """GPU UUID -> the name of its published whole-GPU device."""
    return {d.gpu_uuid: d.name for d in devices if not getattr(d, "is_partition", False)}


class GpuHealthMetrics:
    def __init__(self, gpu_names: Mapping[str, str]) -> None:
        self.gpu_names = dict(gpu_names)  # GPU UUID -> gpu-<minor>
        for uuid, name in self.gpu_names.items():
            for verdict in metrics.XID_VERDICTS:
                metrics.GPU_XID_EVENTS.labels(uuid=uuid, device=name, verdict=verdict)

    def count_xid(self, gpu_uuid: str, verdict: str) -> None:
        name = self.gpu_names.get(gpu_uuid, UNKNOWN_GPU)
        metrics.GPU_XID_EVENTS.labels(uuid=gpu_uuid, device=name, verdict=verdict).inc()

    def update(self, store: HealthStore, recovery: RecoveryTaints | None = None) -> None:
        for uuid, name in self.gpu_names.items():
            failed = store.device_failure(WholeGpu(name, uuid)) is not None or (
                recovery is not None and recovery.device_failure(name) is not None
            )
            metrics.GPU_HEALTHY.labels(uuid=uuid, device=name).set(0.0 if failed else 1.0)


def tainted_device_names(
    store: HealthStore, devices: Sequence[HealthDevice], recovery: RecoveryTaints | None
) -> set[str]:
    """The devices with a recorded failure or a recovery-action taint."""
    names = set(store.device_failures(devices))
    if recovery is not None:
        names.update(d.name for d in devices if recovery.device_failure(d.name) is not None)
    return names
