"""The /dev/shm that a device's MPS daemon shares with its clients (docs/mps.md,
"Directories, users and /dev/shm").

A daemon's `shm/` directory is /dev/shm in the daemon (its pod, or a node daemon's
mount namespace) and in every container of the claim: MPS server and clients share
memory through files there. A plain directory would be on the disk of the plugin's
data directory, with no bound of its own: a tenant could fill the node's disk. So at
prepare, before the daemon starts, `ShmBound.apply` mounts a tmpfs of `--mps-shm-size`
bytes on it (mode 1777, nosuid, nodev, noexec), and `ShmBound.release` unmounts it
before the directory is removed: at unprepare, at a rollback (a failed prepare, an
intent the start's recovery finds in the journal) and at the sweep of a directory no
claim owns (driver/state/mps/claim_daemons.py, driver/state/mps/orphans.py). Only a
prepare mounts: a daemon started again keeps what its clients' containers hold bind
mounts of, tmpfs or plain directory (a tmpfs mounted then would be another /dev/shm
than theirs).

Where the plugin may not mount (no CAP_SYS_ADMIN: mount(2) fails with EPERM, as for
the chart's unprivileged plugin on the mock), or where its mount would not reach the
node (a plugin in a pod whose data directory is not mounted with Bidirectional
propagation), the directory stays plain, unbounded, as the first such prepare says
once at WARNING; the prepare goes on. A mount that fails for another reason fails the
prepare with a transient error. `--mps-shm-size=0` turns the tmpfs off.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Final, Protocol

from driver.devices.formatting import parse_quantity
from driver.errors import transient

log = logging.getLogger(__name__)

MIB: Final = 1 << 20
DEFAULT_SIZE: Final = "1Gi"
SHM_MODE: Final = 0o1777  # every client uid writes its files; only their owner removes them
# mount(2) and umount2(2) flags (<sys/mount.h>).
MOUNT_FLAGS: Final = 0x2 | 0x4 | 0x8  # MS_NOSUID | MS_NODEV | MS_NOEXEC
UNMOUNT_FLAGS: Final = 0x2 | 0x8  # MNT_DETACH | UMOUNT_NOFOLLOW
SOURCE: Final = "gpu-dra-mps-shm"  # the mount's source, as /proc/mounts shows it
_MAX_UNMOUNTS: Final = 8  # stacked mounts unmounted in one release, at most


def shm_size(text: str) -> int:
    """`--mps-shm-size`: a quantity of bytes (`1Gi`, `512Mi`), at least 1Mi, or 0 (no
    tmpfs: the plain directory)."""
    try:
        value = parse_quantity(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a quantity of bytes (e.g. 1Gi, 512Mi)") from None
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    size = int(value)
    if size != 0 and size < MIB:
        raise ValueError(f"must be 0 (no tmpfs) or at least 1Mi, got {text!r}")
    return size


class Mounts(Protocol):
    """The mount table as the plugin sees it, and the calls that change it
    (`HostMounts`; tests give a fake)."""

    def mount_tmpfs(self, target: Path, flags: int, options: str) -> None:
        """mount(2) a tmpfs at `target`; OSError with the errno on failure."""

    def unmount(self, target: Path) -> None:
        """Detach the mount at `target` (the top one); OSError on failure."""

    def mounted(self, target: Path) -> bool:
        """Is something mounted at `target`?"""

    def propagates(self, target: Path) -> bool:
        """Would a mount made at `target` be seen by the node (the mount holding
        `target` is in a shared peer group)?"""


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo: space, tab, newline and backslash are octal
    escapes there."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mountinfo(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(mount point, optional fields) of each line of a mountinfo, in its order (a
    later mount at the same point is on top)."""
    found = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        optional = tuple(fields[6 : fields.index("-", 6)])
        found.append((_unescape(fields[4]), optional))
    return found


def _within(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


class HostMounts:
    """`Mounts` through libc's mount(2) and umount2(2) and /proc/self/mountinfo."""

    def __init__(self, mountinfo: Path = Path("/proc/self/mountinfo")) -> None:
        self._mountinfo = mountinfo
        self._libc: ctypes.CDLL | None = None

    def _call(self, name: str, *args: object) -> None:
        if self._libc is None:
            self._libc = ctypes.CDLL(None, use_errno=True)
        if getattr(self._libc, name)(*args) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def mount_tmpfs(self, target: Path, flags: int, options: str) -> None:
        self._call(
            "mount",
            SOURCE.encode(),
            os.fsencode(target),
            b"tmpfs",
            ctypes.c_ulong(flags),
            options.encode(),
        )

    def unmount(self, target: Path) -> None:
        self._call("umount2", os.fsencode(target), ctypes.c_int(UNMOUNT_FLAGS))

    def _table(self) -> list[tuple[str, tuple[str, ...]]]:
        return parse_mountinfo(self._mountinfo.read_text())

    def mounted(self, target: Path) -> bool:
        point = os.path.realpath(target)
        return any(p == point for p, _ in self._table())

    def propagates(self, target: Path) -> bool:
        where = os.path.realpath(target.parent)
        holding = [(len(p), o) for p, o in self._table() if _within(where, p)]
        # The deepest mount holding it, the top one (the last) of those at that point.
        _, optional = max(reversed(holding), key=lambda h: h[0], default=(0, ()))
        return any(o.startswith("shared:") for o in optional)


class ShmBound:
    """A tmpfs of `size` bytes on each daemon's shm directory. `needs_propagation`:
    the plugin runs in a mount namespace of its own (a pod), so its mount must
    propagate to the node, where the daemon's pod and the claim's containers bind the
    directory. `mounts` None: the host's (`HostMounts`)."""

    def __init__(
        self, size: int, mounts: Mounts | None = None, *, needs_propagation: bool = False
    ) -> None:
        self.size = size
        self.mounts: Mounts = mounts if mounts is not None else HostMounts()
        self.needs_propagation = needs_propagation
        self._lock = threading.Lock()
        self._unbounded: str | None = None  # why this plugin leaves the directories plain

    @property
    def unbounded(self) -> str | None:
        """Why the shm directories stay plain, None while they get a tmpfs."""
        return "--mps-shm-size=0" if self.size == 0 else self._unbounded

    def _leave_plain(self, why: str) -> bool:
        with self._lock:
            first, self._unbounded = self._unbounded is None, why
        if first:
            log.warning(
                "the MPS daemons' /dev/shm directories are not bounded: %s; each stays a "
                "plain directory on the disk of the plugin's data directory, which a "
                "claim's containers can fill (docs/mps.md, \"Directories, users and "
                '/dev/shm")',
                why,
            )
        return False

    def apply(self, directory: Path) -> bool:
        """Before the daemon starts: a tmpfs at `directory` (an existing directory)
        unless one is there already. True where one is, False where the directory
        stays plain (said once at WARNING). A mount that fails otherwise than EPERM
        raises a transient error."""
        if self.size == 0:
            return False
        try:
            if self.mounts.mounted(directory):
                return True  # kept: a running container of the claim may hold it
            if self._unbounded is not None:
                return False
            if self.needs_propagation and not self.mounts.propagates(directory):
                return self._leave_plain(
                    f"a tmpfs the plugin mounts at {directory} would not reach the node: "
                    "the plugin's data directory is not mounted with mountPropagation: "
                    "Bidirectional (the chart sets it with kubeletPlugin.mps.enabled on a "
                    "privileged plugin)"
                )
            options = f"size={self.size},mode={SHM_MODE:o}"
            self.mounts.mount_tmpfs(directory, MOUNT_FLAGS, options)
        except OSError as err:
            if err.errno == errno.EPERM:
                return self._leave_plain(
                    f"the plugin may not mount a tmpfs at {directory} (EPERM: it lacks "
                    "CAP_SYS_ADMIN, as an unprivileged plugin does)"
                )
            raise transient(f"mounting a {self.size}-byte tmpfs at {directory}: {err}") from err
        log.info("mounted a tmpfs of %d bytes at %s", self.size, directory)
        return True

    def release(self, directory: Path) -> None:
        """Before the directory goes: unmount every tmpfs on it (whatever the size
        setting now). A mount that stays raises a transient error: the directory and
        the claim's journal entry stay, and the kubelet repeats."""
        for _ in range(_MAX_UNMOUNTS):
            try:
                if not self.mounts.mounted(directory):
                    return
                self.mounts.unmount(directory)
            except OSError as err:
                if err.errno in (errno.EINVAL, errno.ENOENT):
                    continue  # unmounted meanwhile; `mounted` tells
                raise transient(f"unmounting the tmpfs at {directory}: {err}") from err
            log.info("unmounted the tmpfs at %s", directory)
        raise transient(f"{directory} is still a mount point after {_MAX_UNMOUNTS} unmounts")
