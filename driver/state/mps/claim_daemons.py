"""MPS control daemons of prepared claims (docs/mps.md).

A device whose effective GpuConfig is `MPS` gets a daemon of its own, for its GPU
alone: its directory `<plugin data dir>/mps/<digest of the CDI device name>/` holds
`pipe/`
(mounted into the device's containers at /tmp/nvidia-mps, where
CUDA_MPS_PIPE_DIRECTORY points), `log/` and, for a daemon in a pod of its own,
`shm/` (its and its clients' /dev/shm). The daemon is told the config's default
active-thread percentage and pinned device-memory limit through its control pipe; the
container's env carries the same values (MPS clients can only lower them).

Where it runs is an `MpsDaemons`: `NodeDaemons` here (processes of the node), or
driver/kube/mps_daemons.py (a Deployment per device). The daemon's record
(`MpsRecord`) is in the `PrepareStarted` entry before the daemon starts (the intent:
no pid, no Deployment) and carries what identifies it (pid and start time, or the
Deployment's name and UID) in the `PrepareCompleted` entry:

- prepare starts each daemon, sets and reads back its limits (`apply`);
- a rollback stops every daemon the claim's devices may have started, found in their
  place (pipe directory, derived Deployment name) when nothing is recorded yet, and
  removes their directories (`restore`);
- unprepare does the same before the entry is dropped (`release`);
- start (`adopt`) finds each completed claim's daemon; one that is gone (killed, a
  reboot, a deleted Deployment) is reported and started again with its limits
  (`revive`), so new clients are limited again (running clients of the dead daemon
  have lost their GPU work already). While the plugin runs, driver/state/mps_watch.py
  does the same every MPS_WATCH_SECONDS.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Protocol

from driver.cdi.claim_specs import CdiMount
from driver.config.mps_limits import mps_memory_text
from driver.errors import DriverError, transient
from driver.nvml.mps import DaemonDirs, DaemonId, is_running
from driver.observability import metrics
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.prepared_limits import MpsLimits

log = logging.getLogger(__name__)

CONTAINER_PIPE_DIRECTORY: Final = "/tmp/nvidia-mps"
CONTAINER_SHM_DIRECTORY: Final = "/dev/shm"
DIRECTORY_DIGITS: Final = 16


class MpsOps(Protocol):
    """`driver.nvml.mps.MpsControl` (real binary or the mock's stand-in)."""

    def start(self, dirs: DaemonDirs, gpu_uuids: Sequence[str]) -> DaemonId: ...

    def running(self, dirs: DaemonDirs) -> DaemonId | None: ...

    def command(self, dirs: DaemonDirs, line: str) -> str: ...

    def stop(self, dirs: DaemonDirs, daemon: DaemonId | None) -> None: ...


class MpsDaemons(Protocol):
    """Where a device's daemon runs: a process of the node (`NodeDaemons`,
    --mps-daemons=node) or a Deployment of its own (driver/kube/mps_daemons.py,
    --mps-daemons=kubernetes)."""

    # The daemon and its clients share `<dir>/shm` as /dev/shm (a daemon in a pod of
    # its own); False: the daemon uses the host's /dev/shm (a process of the node).
    private_shm: bool

    def start(self, record: MpsRecord, dirs: DaemonDirs) -> MpsRecord:
        """Start it with the record's limits set and checked; the record stamped with
        what identifies it. Raises a transient error, leaving nothing running."""
        ...

    def alive(self, record: MpsRecord) -> bool: ...

    def not_ready(self, record: MpsRecord) -> str | None:
        """Why a daemon that is alive does not serve now (its pod not ready: Kubernetes
        restarts it), None if it does."""
        ...

    def stop(self, record: MpsRecord, dirs: DaemonDirs, *, any_instance: bool = False) -> None:
        """Stop it and wait until it is gone: the recorded one, or whatever runs in its
        place for an intent (nothing recorded yet) or with `any_instance`."""
        ...


@dataclass(frozen=True)
class MpsSite:
    """Where this node's daemons keep their directories (what planning is told)."""

    root: Path
    private_shm: bool


@dataclass(frozen=True)
class MpsLoss:
    """A device's daemon found gone, and what became of it: started again
    (`restarted`, its new record) or not (`error`)."""

    device: str
    lost: MpsRecord
    restarted: MpsRecord | None = None
    error: str | None = None

    @property
    def outcome(self) -> str:
        """The label of gpu_dra_mps_daemon_lost_total."""
        return "failed" if self.restarted is None else "restarted"


def daemon_text(record: MpsRecord) -> str:
    """`Deployment <name>` or `pid <pid>`: which daemon the record names."""
    return f"Deployment {record.deployment}" if record.deployment else f"pid {record.pid}"


@dataclass(frozen=True)
class MpsPlan:
    record: MpsRecord
    env: tuple[str, ...]
    mounts: tuple[CdiMount, ...]


def daemon_directory(cdi_name: str) -> str:
    """The daemon's directory under the MPS root: a digest of the CDI device name (a
    claim UID, the device and a share id: 80 characters and more). The daemon's
    control sockets live in its pipe directory, and a unix socket's path is at most
    107 bytes; the digest is also a valid label value (63 at most)."""
    return hashlib.sha256(cdi_name.encode()).hexdigest()[:DIRECTORY_DIGITS]


def daemon_dirs(root: Path, record: MpsRecord) -> DaemonDirs:
    base = root / record.directory
    return DaemonDirs(base / "pipe", base / "log", base / "shm")


def plan_mps(
    limits: MpsLimits | None, *, gpu_uuid: str, cdi_name: str, site: MpsSite | None
) -> MpsPlan | None:
    """The daemon of a device prepared with `limits` (driver/state/mps/prepared_limits.py), None
    for no daemon; `site` None only with no limits (a node without MPS)."""
    if limits is None or site is None:
        return None
    memory = limits.pinned_memory_bytes
    record = MpsRecord(
        gpu_uuid, daemon_directory(cdi_name), limits.active_thread_percentage, memory
    )
    env = [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIRECTORY}"]
    if record.active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={record.active_thread_percentage}")
    if memory is not None:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mps_memory_text(memory)}")
    dirs = daemon_dirs(site.root, record)
    mounts = [CdiMount(str(dirs.pipe), CONTAINER_PIPE_DIRECTORY)]
    if site.private_shm:
        mounts.append(CdiMount(str(dirs.shm), CONTAINER_SHM_DIRECTORY))
    return MpsPlan(record, tuple(env), tuple(mounts))


def _megabytes(answer: str) -> int | None:
    """`8192M` / `8G` (what the daemon answers) as MiB."""
    text = answer.strip()
    if text[:-1].isdigit() and text[-1:] in ("M", "G"):
        return int(text[:-1]) * (1024 if text[-1] == "G" else 1)
    return None


def configure_limits(ops: MpsOps, dirs: DaemonDirs, record: MpsRecord) -> None:
    """Tell the daemon in `dirs` the record's limits through its control pipe and read
    them back (transient error when it does not hold them)."""
    if record.active_thread_percentage is not None:
        wanted = record.active_thread_percentage
        ops.command(dirs, f"set_default_active_thread_percentage {wanted}")
        answer = ops.command(dirs, "get_default_active_thread_percentage")
        if answer.strip() not in (str(wanted), f"{wanted}.0"):
            raise transient(
                f"MPS daemon in {dirs.pipe} did not take active thread percentage "
                f"{wanted}: it answers {answer!r}"
            )
    if record.pinned_memory_bytes is not None:
        text = mps_memory_text(record.pinned_memory_bytes)
        ops.command(dirs, f"set_default_device_pinned_mem_limit 0 {text}")
        answer = ops.command(dirs, "get_default_device_pinned_mem_limit 0")
        if _megabytes(answer) != record.pinned_memory_bytes >> 20:
            raise transient(
                f"MPS daemon in {dirs.pipe} did not take pinned memory limit {text}: "
                f"it answers {answer!r}"
            )


class NodeDaemons:
    """`MpsDaemons` as processes of the node, started by the plugin in a session and
    a mount namespace of their own (the plugin outside Kubernetes, the real-GPU tier):
    their /dev/shm is the directory the claim's containers mount there."""

    private_shm = True

    def __init__(self, ops: MpsOps) -> None:
        self.ops = ops

    def start(self, record: MpsRecord, dirs: DaemonDirs) -> MpsRecord:
        daemon = self.ops.start(dirs, [record.gpu_uuid])
        stamped = replace(record, pid=daemon.pid, start_time=daemon.start_time)
        try:
            configure_limits(self.ops, dirs, stamped)
        except DriverError:
            self.ops.stop(dirs, daemon)
            raise
        return stamped

    def alive(self, record: MpsRecord) -> bool:
        return is_running(DaemonId(record.pid, record.start_time))

    def not_ready(self, record: MpsRecord) -> str | None:
        return None  # a process of the node that runs serves

    def stop(self, record: MpsRecord, dirs: DaemonDirs, *, any_instance: bool = False) -> None:
        recorded = record.pid and not any_instance
        daemon = DaemonId(record.pid, record.start_time) if recorded else self.ops.running(dirs)
        self.ops.stop(dirs, daemon)


class ClaimMps:
    """The MPS side of prepare, unprepare and start. `daemons` None: no MPS on this
    node."""

    def __init__(self, daemons: MpsDaemons | None, root: Path) -> None:
        self._daemons = daemons
        self.root = root

    @property
    def site(self) -> MpsSite | None:
        """Where daemons live, None where there is no MPS (what planning is told)."""
        if self._daemons is None:
            return None
        return MpsSite(self.root, self._daemons.private_shm)

    def _start(self, record: MpsRecord) -> MpsRecord:
        assert self._daemons is not None
        dirs = daemon_dirs(self.root, record)
        for directory in (dirs.pipe, dirs.log, *((dirs.shm,) if self._daemons.private_shm else ())):
            directory.mkdir(parents=True, exist_ok=True)
        return self._daemons.start(record, dirs)

    def _stop(self, record: MpsRecord, *, any_instance: bool = False) -> None:
        """Stop the daemon (the recorded one, or whatever runs in its place for an
        intent) and remove its directory."""
        assert self._daemons is not None
        self._daemons.stop(record, daemon_dirs(self.root, record), any_instance=any_instance)
        shutil.rmtree(self.root / record.directory, ignore_errors=True)

    # -- prepare -----------------------------------------------------------------------

    def apply(self, devices: Sequence[PreparedDevice]) -> tuple[PreparedDevice, ...]:
        """Start the daemons of the devices (their intent is durable); the devices with
        their records stamped. A failure stops those started (transient error)."""
        if self._daemons is None or not any(d.mps for d in devices):
            return tuple(devices)
        out: list[PreparedDevice] = []
        try:
            for device in devices:
                record = device.mps
                out.append(
                    device if record is None else replace(device, mps=self._started(device, record))
                )
        except DriverError:
            self.restore(out)
            raise
        return tuple(out)

    def _started(self, device: PreparedDevice, record: MpsRecord) -> MpsRecord:
        try:
            return self._start(record)
        except DriverError as err:
            raise transient(f"device {device.device_name}: {err}") from err

    def restore(self, devices: Sequence[PreparedDevice]) -> None:
        """Stop every daemon the devices may have started. Raises a transient error
        (the caller keeps the entry)."""
        if self._daemons is None:
            return
        for device in devices:
            if device.mps is not None:
                self._stop(device.mps)

    # -- unprepare ---------------------------------------------------------------------

    def release(
        self, journal: Mapping[str, ClaimEntry], uids: Sequence[str]
    ) -> dict[str, DriverError]:
        """Before the entries of `uids` are dropped: stop their daemons. Returns the
        claims whose daemon could not be stopped (they keep their entries)."""
        errors: dict[str, DriverError] = {}
        for uid in uids:
            entry = journal.get(uid)
            if entry is None:
                continue
            try:
                self.restore(entry.devices)
            except DriverError as err:
                log.error("unprepare: stopping the MPS daemon of claim %s failed: %s", uid, err)
                errors[uid] = err
        return errors

    # -- start -------------------------------------------------------------------------

    def adopt(
        self, journal: dict[str, ClaimEntry], exclude: Collection[str] = ()
    ) -> tuple[list[str], dict[str, tuple[MpsLoss, ...]]]:
        """At start: each completed claim's daemons (but those of `exclude`, claims
        another instance has in flight), found running by pid and start
        time, are adopted; one that is gone is reported and started again (`revive`,
        its entry in `journal` updated). Returns (the claims adopted, per claim whose
        daemon was gone what became of it)."""
        adopted: list[str] = []
        lost: dict[str, tuple[MpsLoss, ...]] = {}
        if self._daemons is None:
            return adopted, lost
        for uid, entry in sorted(journal.items()):
            if uid in exclude or entry.state is not ClaimState.PREPARE_COMPLETED:
                continue
            if not any(d.mps for d in entry.devices):
                continue
            journal[uid], losses = self.revive(uid, entry)
            if losses:
                lost[uid] = losses
            else:
                adopted.append(uid)
        return adopted, lost

    def revive(self, uid: str, entry: ClaimEntry) -> tuple[ClaimEntry, tuple[MpsLoss, ...]]:
        """Under the node lock: the completed claim's daemons that are gone (killed, a
        reboot, a deleted Deployment) started again with their limits, whatever is left
        in their place stopped first, so new clients are limited again (running clients
        of the dead daemon have lost their GPU work already). Returns the entry with
        their new records (one that could not be started keeps the lost record: it is
        tried again next time) and what became of each."""
        assert self._daemons is not None
        devices: list[PreparedDevice] = []
        losses: list[MpsLoss] = []
        for device in entry.devices:
            record = device.mps
            if record is not None and not self._daemons.alive(record):
                log.error(
                    "the MPS daemon %s of claim %s (GPU %s) is gone; starting it again",
                    daemon_text(record),
                    uid,
                    record.gpu_uuid,
                )
                try:
                    self._stop(record, any_instance=True)  # what is left in its place
                    started = self._start(record)
                except DriverError as err:
                    log.error("restarting the MPS daemon of claim %s failed: %s", uid, err)
                    losses.append(MpsLoss(device.device_name, record, error=str(err)))
                else:
                    losses.append(MpsLoss(device.device_name, record, restarted=started))
                    device = replace(device, mps=started)
                metrics.MPS_DAEMONS_LOST.labels(outcome=losses[-1].outcome).inc()
            devices.append(device)
        return replace(entry, devices=tuple(devices)), tuple(losses)

    def not_ready(self, record: MpsRecord) -> str | None:
        """Why a daemon that is there does not serve (its pod not ready), None if it
        does."""
        assert self._daemons is not None
        return self._daemons.not_ready(record)
