"""The MIG instances of one mock node (`MigStore`): in memory, or, with a driver root,
in `<root>/run/nvidia-mock/mig-state.json`, so that two processes on the same driver
root (a plugin and a restarted plugin, or a CLI) see the same instances, as they would
on a real GPU. Every change is a read-modify-write under an exclusive `fcntl.flock` on
`mig-state.lock`; writes are atomic (temporary file, rename). A query that only looks
(`MigStore.read`) reads the file without the lock.

State file (version 1): `{"version": 1, "serial": N, "gpus": {"<GPU UUID>": [GI...]}}`
with GI `{"id", "profile", "start", "size", "serial", "cis": [CI...]}` and CI
`{"id", "profile", "start", "size", "serial"}`: `profile` is the GI/CI profile ID,
`start`/`size` the placement (memory slices of the GPU for a GI, compute slices of
the GI for a CI), `serial` a number never reused, so a handle to a destroyed instance
stays invalid even when the ID is taken again.

With a driver root, every change also rewrites the capability files the NVIDIA driver
exposes for MIG (NVIDIA/open-gpu-kernel-modules: nv-caps.c, arch/nvalloc/unix/src/os.c):
`proc/driver/nvidia/capabilities/gpu<GPU minor>/mig/gi<GI>/access` and
`.../gi<GI>/ci<CI>/access`, three lines each: `DeviceFileMinor: <nvidia-cap minor>`,
`DeviceFileMode: 292` (0444 in decimal), `DeviceFileModify: 1`; the driver's
`capabilities/mig/config` (minor 1, mode 256) and `mig/monitor` (minor 2, mode 292);
and, once, `proc/driver/nvidia-caps/mig-minors` (see `mig_minor`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

from driver.nvml.mock.fleet import MockGpu
from driver.nvml.mock.mig.mig_state import (
    CAP_GPUS,
    CAPABILITIES_DIR,
    CI_SLOT,
    MIG_MINORS_FILE,
    MODE_RUSR,
    STATE_FILE,
    CiRecord,
    GiRecord,
    State,
    access_text,
    ci_profiles,
    create_ci,
    create_gi,
    mig_minor,
    mig_minors_text,
)


def _atomic_write(path: Path, text: str) -> None:
    """Replace `path` at once: a reader sees the old or the new text, never a part.
    No fsync: a mock's driver root need not survive a power loss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as f:
        f.write(text)
    os.replace(f.name, path)


def _ensure(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _prune(directory: Path, keep: set[str]) -> None:
    for d in directory.iterdir():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d)


class MigStore:
    """The MIG instances of one node: in memory, or a JSON file under a driver root."""

    def __init__(self, gpus: Sequence[MockGpu], driver_root: Path | None) -> None:
        self.gpus = gpus
        self.root = driver_root
        self._lock = threading.Lock()
        self._memory: State | None = None
        self._last_read: tuple[str, State] | None = None  # the file's text, parsed

    def read(self) -> State:
        """The state as it is now, for looking only (never changed, never saved).

        With a driver root the file is read without the lock (writes replace it at
        once) and parsed again only when its text changed: another process's change
        is seen at the next call, an unchanged state is not parsed again."""
        if self.root is None:
            with self._lock:
                if self._memory is None:
                    self._memory = self.boot()
                return self._memory
        try:
            text = (self.root / STATE_FILE).read_text()
        except FileNotFoundError:
            return self.boot()
        last = self._last_read
        if last is not None and last[0] == text:
            return last[1]
        state = _load(text)
        self._last_read = (text, state)
        return state

    def boot(self, serial: int = 0) -> State:
        """The state after a boot: the fleet's static instances, one CI covering each."""
        st = State(serial)
        for gpu in self.gpus:
            if gpu.mig_enabled and gpu.profile.mig is not None:
                for p in gpu.static_mig:
                    gi = create_gi(st, gpu, p.profile, (p.start, p.size))
                    full = CI_SLOT[p.profile.sliceCount]
                    create_ci(st, gi, ci_profiles(gpu.profile.mig, p.profile)[full])
        return st

    @contextlib.contextmanager
    def open(self) -> Iterator[State]:
        """The state, saved when the block ends without an exception."""
        with self._lock:
            if self.root is None:
                st = copy.deepcopy(self._memory) if self._memory else self.boot()
                yield st
                self._memory = st
                return
            path = self.root / STATE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                before = path.read_text() if path.exists() else None
                st = _load(before) if before is not None else self.boot()
                yield st
                after = _dump(st)
                if after != before:
                    _atomic_write(path, after)
                    self._sync_capabilities(st)

    def _sync_capabilities(self, st: State) -> None:
        root = cast(Path, self.root)
        if not (root / MIG_MINORS_FILE).exists():
            _atomic_write(root / MIG_MINORS_FILE, mig_minors_text())
        caps = root / CAPABILITIES_DIR
        _ensure(caps / "mig/config", access_text(1, MODE_RUSR))
        _ensure(caps / "mig/monitor", access_text(2))
        for gpu in self.gpus:
            if gpu.minor >= CAP_GPUS:
                continue  # the driver has capability minors for gpu0..31 only
            mig_dir = caps / f"gpu{gpu.minor}/mig"
            mig_dir.mkdir(parents=True, exist_ok=True)
            gis = st.gpus.get(gpu.uuid, [])
            _prune(mig_dir, {f"gi{gi.id}" for gi in gis})
            for gi in gis:
                _ensure(mig_dir / f"gi{gi.id}/access", access_text(mig_minor(gpu.minor, gi.id)))
                _prune(mig_dir / f"gi{gi.id}", {f"ci{ci.id}" for ci in gi.cis})
                for ci in gi.cis:
                    text = access_text(mig_minor(gpu.minor, gi.id, ci.id))
                    _ensure(mig_dir / f"gi{gi.id}/ci{ci.id}/access", text)


def _dump(st: State) -> str:
    gpus = {u: [dataclasses.asdict(gi) for gi in gis] for u, gis in st.gpus.items() if gis}
    return json.dumps({"version": 1, "serial": st.serial, "gpus": gpus}, indent=1) + "\n"


def _load(text: str) -> State:
    data = json.loads(text)
    gpus = {
        u: [GiRecord(**{**gi, "cis": [CiRecord(**ci) for ci in gi["cis"]]}) for gi in gis]
        for u, gis in data["gpus"].items()
    }
    return State(int(data["serial"]), gpus)
