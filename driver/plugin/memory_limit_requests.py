"""The plugin's side of the memory-limit hook (driver/cdi/memory_limit_hook.py): a
thread that answers the hook's requests by setting the claim's memory share as a
hard limit on the container's cgroup (`GpuMemoryLimits.limit_process`).

Every `POLL_SECONDS` it lists the request directory; a `<name>.req` is taken by
renaming it to `<name>.work` (of two plugin instances during a rolling update, one
takes it), its first line read as `<GPU UUID> <bytes>` and the rest as the OCI state,
whose `pid` is the container's on the host (the plugin runs in the host's PID
namespace). The answer is `<name>.ok`, or `<name>.err` with why not, written
atomically; the hook removes it and the rest of its files. Files of a hook that gave
up (no answer in its wait) are removed once older than `stale_seconds`: at start,
while it runs, and all of a claim's at its unprepare (`ForgetRequestsOnUnprepare`).
Nothing is cleared at unprepare: a container's cgroup, and with it its limit, goes
with the container.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

from driver.cdi.memory_limit_hook import (
    REQUEST_DIR_MODE,
    TIMEOUT_MARGIN_SECONDS,
    MemoryLimitSite,
    request_prefix,
    site_for,
)
from driver.errors import DriverError
from driver.fileio import atomic_write
from driver.nvml.backend import NvmlBackend
from driver.nvml.cgroups import DEFAULT_CGROUP_ROOT, DEFAULT_PROC_ROOT
from driver.nvml.discovered import Inventory
from driver.nvml.memory_limits import GpuMemoryLimits, MemoryLimitError
from driver.plugin.dra import ClaimPreparer
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef, PrepareResult

log = logging.getLogger(__name__)

POLL_SECONDS: Final = 0.05
THREAD_NAME: Final = "memory-limit-requests"
_SUFFIXES: Final = (".req", ".work", ".ok", ".err", ".tmp")


class RequestError(ValueError):
    """A request that cannot be read (one line, for the `.err` answer)."""


def parse_request(data: bytes) -> tuple[str, int, int]:
    """(GPU UUID, bytes, pid) of a request file: `<uuid> <bytes>\\n` and the OCI state."""
    head, _, state = data.partition(b"\n")
    fields = head.decode(errors="replace").split()
    if len(fields) != 2 or not fields[1].isdigit():
        raise RequestError(f"malformed request line {head[:200]!r}")
    try:
        doc = json.loads(state)
    except ValueError as err:
        raise RequestError(f"the OCI state is not JSON: {err}") from None
    pid = doc.get("pid") if isinstance(doc, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise RequestError("the OCI state names no container pid")
    return fields[0], int(fields[1]), pid


class MemoryLimitRequests:
    """Answers the hook's requests in `directory` (see the module doc)."""

    def __init__(
        self,
        directory: Path,
        limits: GpuMemoryLimits,
        *,
        proc_root: Path | str = DEFAULT_PROC_ROOT,
        cgroup_root: Path | str = DEFAULT_CGROUP_ROOT,
        stale_seconds: float = 60.0,
        poll_seconds: float = POLL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self._limits = limits
        self._proc_root = proc_root
        self._cgroup_root = cgroup_root
        self._stale = stale_seconds
        self._poll = poll_seconds
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.answered = 0  # requests answered (ok or err)

    # -- one pass -----------------------------------------------------------------------

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []

    def serve_once(self) -> int:
        """Answer every pending request; the number answered."""
        done = sum(
            self._answer(n.removesuffix(".req")) for n in self._names() if n.endswith(".req")
        )
        self.answered += done
        return done

    def _answer(self, stem: str) -> bool:
        work = self.directory / f"{stem}.work"
        try:
            os.rename(self.directory / f"{stem}.req", work)  # taken: no other instance has it
            data = work.read_bytes()
        except FileNotFoundError:
            return False  # another instance took it, or the hook gave up
        answer, text = f"{stem}.ok", ""
        try:
            gpu, share, pid = parse_request(data)
            seen = self._limits.limit_process(
                gpu, pid, share, proc_root=self._proc_root, cgroup_root=self._cgroup_root
            )
        except (RequestError, MemoryLimitError) as err:
            log.error("memory limit request %s: %s", stem, err)
            answer, text = f"{stem}.err", str(err)
        except Exception as err:  # a bug here must not leave the container unlimited
            log.exception("memory limit request %s failed", stem)
            answer, text = f"{stem}.err", f"{type(err).__name__}: {err}"
        else:
            log.info("GPU %s: hard memory limit %d bytes on %s (pid %d)", gpu, share, seen, pid)
        try:
            atomic_write(self.directory / answer, text.encode(), mode=0o600, durable=False)
        except OSError as err:  # the hook times out and fails closed
            log.error("cannot answer memory limit request %s: %s", answer, err)
        with contextlib.suppress(FileNotFoundError):
            work.unlink()
        return True

    def sweep(self, *, prefix: str | None = None, older_than: float | None = None) -> list[str]:
        """Remove request files: a claim's (`prefix`), or those not touched for
        `older_than` seconds (a hook that gave up, an answer nobody read)."""
        removed: list[str] = []
        now = self._clock()
        for name in self._names():
            if not name.startswith(".") and not name.endswith(_SUFFIXES):
                continue  # not ours (atomic_write's temp files start with a dot)
            if prefix is not None and not name.lstrip(".").startswith(f"{prefix}-"):
                continue
            path = self.directory / name
            try:
                if older_than is None or now - path.lstat().st_mtime >= older_than:
                    path.unlink()
                    removed.append(name)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("cannot remove memory limit request file %s: %s", path, err)
        return removed

    def forget(self, claim_uids: Iterable[str]) -> None:
        """At unprepare: the claims' request files go (their containers are gone)."""
        for uid in claim_uids:
            for name in self.sweep(prefix=request_prefix(uid)):
                log.info("removed memory limit request file %s of claim %s", name, uid)

    # -- the thread ---------------------------------------------------------------------

    def start(self) -> None:
        # 0700 (the runtime runs the hook as root), also where it exists already
        self.directory.mkdir(parents=True, exist_ok=True, mode=REQUEST_DIR_MODE)
        os.chmod(self.directory, REQUEST_DIR_MODE)
        for name in self.sweep(older_than=self._stale):
            log.warning("removed stale memory limit request file %s", name)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        last_sweep = self._clock()
        while not self._stop.wait(self._poll):
            try:
                self.serve_once()
                if self._clock() - last_sweep >= self._stale:
                    last_sweep = self._clock()
                    self.sweep(older_than=self._stale)
            except Exception:  # keep answering: a hook without answer fails closed
                log.exception("memory limit requests: pass failed")


class ForgetRequestsOnUnprepare:
    """The plugin's prepare/unprepare, with the request files of each claim whose
    unprepare succeeded removed after it."""

    def __init__(self, state: ClaimPreparer, requests: MemoryLimitRequests) -> None:
        self._state = state
        self._requests = requests

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        return self._state.prepare(claims)

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]:
        results = self._state.unprepare(claims)
        self._requests.forget(uid for uid, error in results.items() if error is None)
        return results


def probe_site(
    limits: GpuMemoryLimits,
    data_dir: Path | str,
    gpu_uuids: Iterable[str],
    *,
    cgroup_root: Path | str = DEFAULT_CGROUP_ROOT,
) -> MemoryLimitSite | None:
    """The memory-limit site for the GPUs whose driver has per-cgroup memory limits;
    None (no hook, no thread) where none has."""
    found: list[str] = []
    for uuid in gpu_uuids:
        why = limits.probe(uuid, cgroup_root)
        if why is None:
            found.append(uuid)
        else:
            log.debug("GPU %s: no per-cgroup memory limits: %s", uuid, why)
    site = site_for(data_dir, found)
    if site is not None:
        log.info(
            "per-cgroup GPU memory limits on %s: memory shares are hard limits on their "
            "containers' cgroups (requests in %s)",
            ", ".join(sorted(site.gpus)),
            site.directory,
        )
    return site


def serve_memory_limits(
    backend: NvmlBackend,
    data_dir: Path,
    inventory: Inventory,
    state: DeviceState,
    running: contextlib.ExitStack,
) -> MemoryLimitRequests | None:
    """Where the node's driver has per-cgroup memory limits (R615 and later): devices
    with a memory share get the hook that hands their containers to the thread started
    here, which sets the share as a hard limit on each container's cgroup
    (docs/mps.md, "Memory limits the kernel driver keeps"). None elsewhere."""
    limits = backend.memory_limits()
    cgroup_root = backend.kernel_root / "sys" / "fs" / "cgroup"
    site = probe_site(
        limits, data_dir, (gpu.uuid for gpu in inventory.gpus), cgroup_root=cgroup_root
    )
    if site is None:
        return None
    requests = MemoryLimitRequests(
        site.directory,
        limits,
        proc_root=backend.kernel_root / "proc",
        cgroup_root=cgroup_root,
        # stale once past any hook's wait
        stale_seconds=float(2 * (site.wait_seconds + TIMEOUT_MARGIN_SECONDS)),
    )
    requests.start()
    running.callback(requests.stop)
    state.context = replace(state.context, memory_limits=site)
    return requests
