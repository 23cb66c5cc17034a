"""GPUs whose health events NVML will not register (`HealthEventSet.unmonitored`).

Such a GPU's Xids and ECC errors go unseen, so its health is unknown, not bad: every
device of it (the GPU and its partitions) carries the taint `<driver>/unmonitored`
with effect `None`, which the scheduler ignores and `kubectl get resourceslices` and
`gpu-dra health` show, as NVIDIA's driver publishes it; `gpu_dra_unmonitored_gpus`
counts them and `gpu-dra status` names them. Prepare does not refuse them. Kept in
memory: each opening of the event set (at start, after an NVML error) says anew.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from driver.health.failures import Devices, device_list
from driver.observability import metrics

KIND_UNMONITORED = "unmonitored"

Taints = Mapping[str, Sequence[Mapping[str, str]]]  # device name -> its taints


class UnmonitoredGpus:
    """GPU UUID -> why its events are not watched. Written by the health monitor's
    thread, read by the slice publisher and /status."""

    def __init__(self, devices: Devices, *, driver: str) -> None:
        self.driver = driver
        self._gpu_of = {d.name: d.gpu_uuid for d in device_list(devices)}
        self._lock = threading.Lock()
        self._reasons: dict[str, str] = {}

    def update(self, reasons: Mapping[str, str]) -> bool:
        """The event set's latest answer; whether the set of unmonitored GPUs changed."""
        published = {uuid: why for uuid, why in reasons.items() if uuid in self._gpu_of.values()}
        with self._lock:
            changed = set(published) != set(self._reasons)
            self._reasons = published
        metrics.UNMONITORED_GPUS.set(len(published))
        return changed

    def reasons(self) -> dict[str, str]:
        with self._lock:
            return dict(self._reasons)

    def add_taints(self, taints: Taints) -> dict[str, list[dict[str, str]]]:
        """`taints` with `<driver>/unmonitored:None` added to every device of an
        unmonitored GPU."""
        merged = {name: [dict(t) for t in listed] for name, listed in taints.items()}
        reasons = self.reasons()
        for name, uuid in self._gpu_of.items():
            if uuid in reasons:
                merged.setdefault(name, []).append(
                    {"key": f"{self.driver}/{KIND_UNMONITORED}", "effect": "None"}
                )
        return merged
