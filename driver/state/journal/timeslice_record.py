"""The journal's record of a GPU time-slice interval set for a prepared device
(`PreparedDevice.time_slice`, key `timeSlice`; docs/sharing.md, "Time-slice
intervals"; docs/state.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

#: The intervals the driver sets (`Default` is what it restores, never recorded).
INTERVALS: Final = ("Short", "Medium", "Long")


@dataclass(frozen=True)
class TimeSliceRecord:
    """The interval a claim's device asks of its (whole, physical) GPU.

    `seq` orders the settings of the claims sharing one GPU: the driver applies the
    interval of the most recently prepared claim still holding the GPU (last writer
    wins). 0 in a `PrepareStarted` entry before the setting was applied: the intent,
    which a rollback undoes whatever the crash left."""

    gpu_uuid: str
    interval: str
    seq: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu_uuid, "interval": self.interval, "seq": self.seq}

    @classmethod
    def from_json(cls, doc: object) -> TimeSliceRecord:
        if not isinstance(doc, Mapping):
            raise ValueError("timeSlice must be an object")
        gpu, interval, seq = doc.get("gpu"), doc.get("interval"), doc.get("seq", 0)
        if not isinstance(gpu, str) or not gpu:
            raise ValueError("timeSlice.gpu must be a GPU UUID")
        if interval not in INTERVALS:
            raise ValueError(f"timeSlice.interval must be one of {', '.join(INTERVALS)}")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValueError("timeSlice.seq must be a non-negative integer")
        return cls(gpu, str(interval), seq)
