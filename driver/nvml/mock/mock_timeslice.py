"""The mock fleet's GPU time-slice intervals: what `nvidia-smi compute-policy
--set-timeslice` would set on a real GPU (driver/nvml/smi_timeslice.py).

Kept in memory, or, with a driver root, in `<root>/run/nvidia-mock/timeslice.json`
(`{"version": 1, "gpus": {"<GPU UUID>": "Long"}}`; a GPU at `Default` is not
listed), so a plugin, its restart and a CLI on the same driver root see the same
settings, as on a real node. Every access is a read-modify-write under an exclusive
`flock` on `timeslice.lock`; writes are atomic (temp file, fsync, rename).
`reboot()` resets every GPU to `Default`, as a node reboot does. A GPU the mock NVML
holds lost fails as nvidia-smi does there (`GpuLostError`, its exit status 15).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Final

from driver.errors import transient
from driver.nvml.smi_timeslice import EXIT_GPU_LOST, GpuLostError

STATE_FILE: Final = Path("run/nvidia-mock/timeslice.json")
INTERVALS: Final = ("Default", "Short", "Medium", "Long")


class MockTimeSlice:
    """`TimeSliceOps` (driver/state/claim_timeslices.py) for the mock fleet's GPUs."""

    def __init__(
        self,
        driver_root: Path | None,
        gpu_uuids: Iterable[str],
        is_lost: Callable[[str], bool] = lambda _uuid: False,
    ) -> None:
        self.root = driver_root
        self.gpu_uuids = frozenset(gpu_uuids)
        self._is_lost = is_lost
        self._lock = threading.Lock()
        self._memory: dict[str, str] = {}

    @property
    def path(self) -> Path | None:
        return None if self.root is None else self.root / STATE_FILE

    @contextlib.contextmanager
    def _open(self) -> Iterator[dict[str, str]]:
        """The settings, saved when the block ends without an exception."""
        with self._lock:
            path = self.path
            if path is None:
                settings = dict(self._memory)
                yield settings
                self._memory = settings
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                before = json.loads(path.read_text())["gpus"] if path.exists() else {}
                settings = dict(before)
                yield settings
                if settings != before:
                    doc = {"version": 1, "gpus": settings}
                    _atomic_write(path, json.dumps(doc, sort_keys=True) + "\n")

    def set(self, gpu_uuid: str, interval: str) -> None:
        if interval not in INTERVALS:
            raise ValueError(f"unknown time-slice interval {interval!r}")
        if gpu_uuid not in self.gpu_uuids:
            raise transient(
                f"cannot set the time-slice interval of GPU {gpu_uuid} to {interval}: "
                f"nvidia-smi (mock): no GPU with UUID {gpu_uuid}"
            )
        if self._is_lost(gpu_uuid):
            raise GpuLostError(
                f"cannot set the time-slice interval of GPU {gpu_uuid} to {interval}: "
                f"nvidia-smi (mock) exited with status {EXIT_GPU_LOST}: Unable to determine "
                "the device handle for GPU: GPU has fallen off the bus"
            )
        with self._open() as settings:
            if interval == "Default":
                settings.pop(gpu_uuid, None)
            else:
                settings[gpu_uuid] = interval

    def get(self, gpu_uuid: str) -> str:
        return self.settings().get(gpu_uuid, "Default")

    def settings(self) -> dict[str, str]:
        """GPU UUID -> interval of every GPU not at `Default`."""
        with self._open() as settings:
            return dict(settings)

    def reboot(self) -> None:
        """Every GPU back to `Default` (a reboot resets the setting)."""
        with self._open() as settings:
            settings.clear()


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
