"""Where a prepared device's MPS control daemon runs, and its directories (docs/mps.md).

An `MpsDaemons` runs daemons of one kind: `NodeDaemons` here (processes of the node,
--mps-daemons=node) or driver/kube/mps_daemons.py (a Deployment per device,
--mps-daemons=kubernetes). A journal record names the kind that started its daemon
(`record_kind`): a pid, or a Deployment. The plugin keeps one of each kind it can reach
whatever --mps-daemons says now, so that a daemon started under another setting is
still stopped at unprepare and swept (driver/state/mps/claim_daemons.py).

A daemon's directory `<plugin data dir>/mps/<digest of the CDI device name>/` holds
`pipe/` (mounted into the device's containers at /tmp/nvidia-mps), `log/` and `shm/`
(the daemon's and its clients' /dev/shm, a tmpfs where the plugin may mount one:
driver/state/mps/shm.py). A daemon started again keeps `pipe/` and `shm/`
(`empty_directory`): the claim's running containers hold bind mounts of those very
directories, and a new directory at the same path would be out of their reach.

Their modes (`make_directories`; docs/mps.md, "Directories, users and /dev/shm"): the
MPS control daemon runs as root, but the MPS server it starts for a client runs as
that client's uid, and the claim's containers may run as any uid. `pipe/` and `shm/`
are 1777 (every uid makes its sockets and files there; only their owner removes
them); the MPS root and the device's directory 0711 (searched on the way to them,
never listed); `log/` 0755, root's: the control daemon writes the logs, and the
driver's copy of the daemon's pid lives there, where no client can write it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import stat
from collections.abc import Collection, Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Final, Protocol

from driver.config.mps_limits import mps_memory_text
from driver.errors import DriverError, transient
from driver.nvml.mps import DaemonDirs, DaemonId, is_running
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.shm import SHM_MODE, ShmBound

log = logging.getLogger(__name__)

DIRECTORY_DIGITS: Final = 16
KIND_NODE: Final = "node"
KIND_KUBERNETES: Final = "kubernetes"


class MpsOps(Protocol):
    """`driver.nvml.mps.MpsControl` (real binary or the mock's stand-in)."""

    def start(
        self, dirs: DaemonDirs, gpu_uuids: Sequence[str], *, multi_user: bool = False
    ) -> DaemonId: ...

    def running(self, dirs: DaemonDirs) -> DaemonId | None: ...

    def command(self, dirs: DaemonDirs, line: str) -> str: ...

    def stop(self, dirs: DaemonDirs, daemon: DaemonId | None) -> None: ...


class MpsDaemons(Protocol):
    """Where a device's daemon runs: a process of the node (`NodeDaemons`,
    --mps-daemons=node) or a Deployment of its own (driver/kube/mps_daemons.py,
    --mps-daemons=kubernetes)."""

    kind: str  # KIND_NODE or KIND_KUBERNETES: which records' daemons it runs
    # The daemon and its clients share `<dir>/shm` as /dev/shm.
    private_shm: bool
    # The tmpfs on `<dir>/shm` (mounted before the daemon starts, unmounted before the
    # directory goes); None: a plain directory, nothing mounted or unmounted.
    shm: ShmBound | None

    def start(self, record: MpsRecord, dirs: DaemonDirs) -> MpsRecord:
        """Start it with the record's limits set and checked; the record stamped with
        what identifies it. Raises a transient error, leaving nothing running."""

    def alive(self, record: MpsRecord) -> bool: ...

    def not_ready(self, record: MpsRecord) -> str | None:
        """Why a daemon that is alive does not serve now (its pod not ready: Kubernetes
        restarts it), None if it does."""

    def observe(self, record: MpsRecord) -> MpsRecord:
        """The record with what runs for it now (its pod's UID and restarts); the
        record itself where nothing more is known."""

    def leftovers(self, owned: Collection[MpsRecord]) -> list[str]:
        """This node's daemons that none of `owned` names and that no directory
        leads to (Deployments); raises a transient error when they cannot be listed."""

    def remove(self, leftover: str) -> str:
        """Stop one of `leftovers` and wait until it is gone; what it was."""

    def stop(
        self, record: MpsRecord, dirs: DaemonDirs, *, any_instance: bool = False
    ) -> str | None:
        """Stop it and wait until it is gone: the recorded one, or whatever runs in its
        place for an intent (nothing recorded yet) or with `any_instance`. What was
        stopped (`pid 12`, `Deployment ns/name`), None where nothing ran."""


def record_kind(record: MpsRecord) -> str | None:
    """The kind of `MpsDaemons` that started the record's daemon; None for an intent
    (it may have started it under either)."""
    if record.deployment:
        return KIND_KUBERNETES
    return KIND_NODE if record.pid else None


def daemon_directory(cdi_name: str) -> str:
    """The daemon's directory under the MPS root: a digest of the CDI device name (a
    claim UID, the device and a share id: 80 characters and more). The daemon's
    control sockets live in its pipe directory, and a unix socket's path is at most
    107 bytes; the digest is also a valid label value (63 at most)."""
    return hashlib.sha256(cdi_name.encode()).hexdigest()[:DIRECTORY_DIGITS]


def daemon_dirs(root: Path, record: MpsRecord) -> DaemonDirs:
    base = root / record.directory
    return DaemonDirs(base / "pipe", base / "log", base / "shm")


def _set_mode(directory: Path, mode: int) -> None:
    """`directory`'s mode, set on the directory itself (never through a link; the
    umask, which the plugin narrows while it binds its sockets, plays no part). One
    that another user owns is refused: the driver made it, or someone else did."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise transient(f"opening the MPS directory {directory}: {err}") from err
    try:
        found = os.fstat(fd)
        if found.st_uid != os.geteuid():
            raise transient(
                f"the MPS directory {directory} belongs to uid {found.st_uid}, not to the plugin's"
            )
        if stat.S_IMODE(found.st_mode) != mode:
            os.fchmod(fd, mode)
    except OSError as err:
        raise transient(f"setting the mode of the MPS directory {directory}: {err}") from err
    finally:
        os.close(fd)


def make_directories(root: Path, dirs: DaemonDirs) -> None:
    """A daemon's directories under the MPS root `root`, made where missing and kept
    where they are (a claim's containers may hold them), each with its mode (the
    module's docstring says why)."""
    wanted = [(root, 0o711), (dirs.pipe.parent, 0o711), (dirs.pipe, 0o1777), (dirs.log, 0o755)]
    if dirs.shm is not None:
        wanted.append((dirs.shm, SHM_MODE))
    for directory, mode in wanted:
        try:
            directory.mkdir(parents=directory == root, exist_ok=True)
        except OSError as err:
            raise transient(f"making the MPS directory {directory}: {err}") from err
        _set_mode(directory, mode)


def unsearchable_parent(root: Path) -> Path | None:
    """The first directory above `root` that users other than its owner and group may
    not search, None where they may reach `root`: an MPS server of a node daemon runs
    as its client's uid and opens its pipe directory by the host's path."""
    for parent in root.parents:
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return parent
        except OSError:
            return parent
    return None


def empty_directory(directory: Path) -> None:
    """Remove what `directory` holds and keep the directory itself (its inode: what
    a container's bind mount of it holds). Links are removed, never followed."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise transient(f"emptying {directory}: {err}") from err


# The control daemon's answer to `get_default_device_pinned_mem_limit <dev>`: a number,
# whole or with decimals, and a binary unit (`M` is MiB: what `set_...` and
# CUDA_MPS_PINNED_DEVICE_MEM_LIMIT take), perhaps spelt `MB`/`MiB`, perhaps after a
# space, or none (bytes); a label ending in `:` before it is ignored.
_LIMIT_ANSWER: Final = re.compile(
    r"(?:[^:]*:)?\s*(\d+)(?:\.(\d+))?\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE
)
_UNIT_BYTES: Final = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def pinned_limit_range(answer: str) -> tuple[int, int] | None:
    """The bytes (lowest, highest) that the daemon's answer for a pinned limit stands
    for; None where it is not one. A whole number with its unit (`20389M`, `8G`,
    `20878336K`, `21379416064`) is exact; one with decimals (`19.91G`) is the limit
    rounded or cut to the digits shown: from half a last digit below to a whole last
    digit above (19.91G: 20382.72 MiB up to, not including, 20398.08 MiB)."""
    found = _LIMIT_ANSWER.fullmatch(answer.strip())
    if found is None:
        return None
    whole, decimals, unit = found.group(1), found.group(2) or "", found.group(3).upper()
    scale = 10 ** len(decimals)
    shown = Fraction(int(whole + decimals), scale) * _UNIT_BYTES[unit]
    if not decimals:
        return int(shown), int(shown)
    step = Fraction(_UNIT_BYTES[unit], scale)
    return math.ceil(shown - step / 2), math.ceil(shown + step) - 1


def pinned_limit_matches(answer: str, limit_bytes: int) -> bool:
    """Does the daemon's answer say it holds the pinned limit that
    `set_default_device_pinned_mem_limit` was told for `limit_bytes`: whole MiB, rounded
    down (`mps_memory_text`)?"""
    found = pinned_limit_range(answer)
    told = limit_bytes - limit_bytes % (1 << 20)
    return found is not None and found[0] <= told <= found[1]


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
        if not pinned_limit_matches(answer, record.pinned_memory_bytes):
            raise transient(
                f"MPS daemon in {dirs.pipe} did not take pinned memory limit {text}: "
                f"it answers {answer!r}"
            )


class NodeDaemons:
    """`MpsDaemons` as processes of the node, started by the plugin in a session and
    a mount namespace of their own (the plugin outside Kubernetes, the real-GPU tier):
    their /dev/shm is the directory the claim's containers mount there."""

    kind = KIND_NODE
    private_shm = True

    def __init__(self, ops: MpsOps, *, shm: ShmBound | None = None) -> None:
        self.ops = ops
        self.shm = shm

    def start(self, record: MpsRecord, dirs: DaemonDirs) -> MpsRecord:
        daemon = self.ops.start(dirs, [record.gpu_uuid], multi_user=record.shared)
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

    def observe(self, record: MpsRecord) -> MpsRecord:
        return record  # a new process is a new pid: `alive` tells

    def leftovers(self, owned: Collection[MpsRecord]) -> list[str]:
        return []  # found by their directories (their pid files are there)

    def remove(self, leftover: str) -> str:
        raise ValueError(f"no leftover {leftover!r}: node daemons are found by directory")

    def stop(
        self, record: MpsRecord, dirs: DaemonDirs, *, any_instance: bool = False
    ) -> str | None:
        recorded = record.pid and not any_instance
        daemon = DaemonId(record.pid, record.start_time) if recorded else self.ops.running(dirs)
        ran = daemon is not None and is_running(daemon)
        self.ops.stop(dirs, daemon)
        return f"pid {daemon.pid}" if ran and daemon is not None else None
