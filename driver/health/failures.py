"""The health model: what a recorded failure is and which published devices it covers.

A failure of a whole GPU (keyed by UUID) applies to every device of the GPU. A
failure of one MIG GPU instance (keyed by GPU UUID and the instance's placement in
memory slices) applies to every device of that GPU whose memory slices intersect
the placement: the partition itself, any larger partition containing it, and the
whole GPU; never a partition on other slices. A device covered by several records
shows the strongest (gpu-lost over xid, the whole GPU's over an instance's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

DEFAULT_DRIVER_NAME = "gpu.example.com"
KIND_XID = "xid"
KIND_GPU_LOST = "gpu-lost"
KIND_RANK = {KIND_XID: 1, KIND_GPU_LOST: 2}
# A kind this release does not know (recorded by a newer one) ranks above every known
# kind: nothing this release records may replace it, so a downgrade never forgets it.
UNKNOWN_KIND_RANK = max(KIND_RANK.values()) + 1


def kind_rank(kind: str) -> int:
    return KIND_RANK.get(kind, UNKNOWN_KIND_RANK)


Placement = tuple[int, int]  # (start, size) in memory slices


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
        if self.kind == KIND_GPU_LOST:
            what = "GPU is lost"
        elif self.kind == KIND_XID:
            what = f"Xid {self.value}"
        else:  # a newer release's kind
            what = self.key if self.value is None else f"{self.key}={self.value}"
        extra = f": {self.reason}" if self.reason and self.reason != what else ""
        where = f" on {self.scope()}" if self.placement is not None else ""
        return f"{what}{where}{extra} (since {self.since})"

    def taint(self, driver: str, effect: str) -> dict[str, str]:
        taint = {"key": f"{driver}/{self.kind}", "effect": effect}
        if self.value is not None:
            taint["value"] = self.value
        return taint | time_added(self.since)


Devices = Iterable[HealthDevice] | Mapping[str, HealthDevice]


def device_list(devices: Devices) -> list[HealthDevice]:
    """Devices given as a sequence or as a name -> device mapping."""
    return list(devices.values() if isinstance(devices, Mapping) else devices)


def device_placement(device: object) -> Placement | None:
    """The memory slices a published device occupies: a MIG partition's placement, the
    whole GPU's full-size placement in dynamic MIG mode; None for a device that is
    the whole GPU (or not a MIG device), which every GPU instance intersects."""
    placement = getattr(device, "placement", None)
    if placement is None:
        placement = getattr(getattr(device, "mig", None), "placement", None)
    return None if placement is None else (int(placement[0]), int(placement[1]))


def overlaps(a: Placement | None, b: Placement) -> bool:
    """Whether the memory slices of `a` (None: the whole GPU) and `b` intersect."""
    return a is None or (a[0] < b[0] + b[1] and b[0] < a[0] + a[1])


RFC3339_UTC = "%Y-%m-%dT%H:%M:%SZ"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime(RFC3339_UTC)


def time_added(since: str) -> dict[str, str]:
    """A taint's `timeAdded`: when its failure was recorded. Without it the API server
    stamps the taint at every write of its slice, and NoExecute's `tolerationSeconds`
    would count again from each (another device of the slice failing, a restart's
    republish). Nothing for a time that does not parse (a record of an older release)."""
    try:
        datetime.strptime(since, RFC3339_UTC)
    except ValueError:
        return {}
    return {"timeAdded": since}


def precedence(failure: GpuFailure) -> tuple[int, bool, Placement]:
    """Sort key, strongest first: gpu-lost, then the whole GPU's, then by placement."""
    return (-kind_rank(failure.kind), not failure.whole_gpu, failure.placement or (0, 0))
