"""Events on the Node when a GPU's devices are tainted or their taint is cleared.

`TaintEvents.change(gpu_uuid, cause)` wraps one change of the health store: it
compares which devices of the GPU show which failure before and after, and posts

- `GpuTainted` (Warning) for each failure that now covers devices it did not before
  (a fatal Xid, a lost GPU, a failed MIG GPU instance): which GPU, why, the taint
  and the devices that carry it;
- `GpuTaintCleared` (Normal) when devices lost their taint: which GPU, the cause
  (NVML's recovery event, `gpu-dra health clear`), what was recorded.

A change that moves no taint (a repeated Xid) posts nothing. When the GPU's devices
keep a taint the store does not hold (NVML's recovery action, `kept_taint`), the
`GpuTaintCleared` message says so: the devices are not free for pods yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from driver.devices.formatting import taint_text
from driver.health.failures import Devices, GpuFailure, HealthDevice, device_list
from driver.health.store import HealthStore
from driver.kube.kube_events import NodeEvent

REASON_TAINTED = "GpuTainted"
REASON_CLEARED = "GpuTaintCleared"
NAMES_SHOWN = 5


class TaintingAction(Protocol):
    """What the health code needs of `driver.health.recovery_taints.RecoveryFailure`."""

    def taint(self, driver: str) -> dict[str, str] | None: ...
    def message(self) -> str: ...


class RecoveryTaints(Protocol):
    """What the health code needs of `driver.health.recovery_taints.RecoveryActions`."""

    @property
    def driver(self) -> str: ...

    def tainting(self, gpu_uuid: str) -> TaintingAction | None: ...


def kept_taint(recovery: RecoveryTaints | None, gpu_uuid: str) -> str | None:
    """`<key>=<value>:<effect> (<why>)` of the taint that NVML's recovery action keeps
    on every device of the GPU whatever the health store says; None if none."""
    if recovery is None or (action := recovery.tainting(gpu_uuid)) is None:
        return None
    taint = action.taint(recovery.driver)
    return None if taint is None else f"{taint_text(taint)} ({action.message()})"


class EventSink(Protocol):
    """What the health code needs of `driver.kube.kube_events.NodeEvents`."""

    def post(self, event: NodeEvent) -> None: ...


def device_names_text(devices: Sequence[str]) -> str:
    shown = ", ".join(devices[:NAMES_SHOWN])
    more = len(devices) - NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


class TaintEvents:
    def __init__(
        self,
        sink: EventSink,
        store: HealthStore,
        devices: Devices,
        *,
        driver: str,
        effect: str,
        gpu_names: Mapping[str, str],
        recovery: RecoveryTaints | None,
    ) -> None:
        self._sink = sink
        self._recovery = recovery
        self._store = store
        self._devices: list[HealthDevice] = device_list(devices)
        self._driver = driver
        self._effect = effect
        self._gpu_names = dict(gpu_names)

    @contextlib.contextmanager
    def change(self, gpu_uuid: str, cause: str) -> Iterator[None]:
        """Posts what the store change made in the block did to the GPU's taints.
        `cause`: why a taint would go, for `GpuTaintCleared`."""
        gpu_devices = [d for d in self._devices if d.gpu_uuid == gpu_uuid]
        before = self._store.device_failures(gpu_devices)
        yield
        after = self._store.device_failures(gpu_devices)
        gpu = f"{self._gpu_names.get(gpu_uuid, gpu_uuid)} ({gpu_uuid})"
        new: dict[GpuFailure, list[str]] = {}
        for name, failure in after.items():
            if failure not in before.values():
                new.setdefault(failure, []).append(name)
        for failure, names in new.items():
            self._sink.post(
                NodeEvent(
                    REASON_TAINTED,
                    f"{gpu}: {failure.message()}; taint "
                    f"{taint_text(failure.taint(self._driver, self._effect))} on {len(names)} "
                    f"device(s): {device_names_text(names)}",
                    "Warning",
                )
            )
        untainted = [name for name in before if name not in after]
        if untainted:
            was = "; ".join(dict.fromkeys(before[n].message() for n in untainted))
            kept = kept_taint(self._recovery, gpu_uuid)
            self._sink.post(
                NodeEvent(
                    REASON_CLEARED,
                    f"{gpu}: {cause}; taint removed from {len(untainted)} device(s): "
                    f"{device_names_text(untainted)} (was: {was})"
                    + (f"; they keep {kept}" if kept else ""),
                    "Normal",
                )
            )
