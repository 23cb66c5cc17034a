"""An MPS control daemon of the driver root (docs/mps.md): `nvidia-cuda-mps-control`
started with `-d` for the GPUs of one prepared device, told its limits through its
control pipe, stopped with `quit -t QUIT_TIMEOUT_SECONDS`.

The daemon daemonizes itself; it is started in a session of its own as well, so that
nothing the plugin's process group receives reaches it: it outlives a plugin restart
and is found again by what the journal records, its pid and the pid's start time
(`/proc/<pid>/stat`), so a recycled pid is never mistaken for it.

The daemon writes its pid to `nvidia-cuda-mps-control.pid` in its pipe directory,
which the claim's containers mount read-write: a tenant can write any pid there. It
is read once, while the daemon starts, and taken only for a process that started
after the start began with the pipe directory in its environment; the driver keeps
its own copy, `daemon.pid`, in the log directory, which no container mounts, and
reads only that one afterwards.

The mock's driver root holds a stand-in binary of the same name
(driver/nvml/mock/mps_control.py); this module runs whichever it finds.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from driver.errors import transient
from driver.nvml.library import LIBRARY_DIRS
from driver.nvml.smi_timeslice import BINARY_DIRS

log = logging.getLogger(__name__)

BINARY: Final = "nvidia-cuda-mps-control"
PID_FILE: Final = "nvidia-cuda-mps-control.pid"  # the daemon's, in its pipe directory
DAEMON_PID_FILE: Final = "daemon.pid"  # the driver's copy, in the log directory
# `quit -t` (nvidia-cuda-mps-control(1)): the daemon stops taking clients and waits at
# most this long for its MPS servers' clients to exit before it ends the servers. The
# clients of a daemon being stopped have exited (unprepare comes after the claim's
# pods) or lost the daemon already (a revival): nobody is cut short who would finish.
QUIT_TIMEOUT_SECONDS: Final = 10
DEFAULT_TIMEOUT: Final = 30.0  # > QUIT_TIMEOUT_SECONDS: the wait for a quit daemon
_POLL: Final = 0.05


@dataclass(frozen=True)
class DaemonId:
    """A running process, told apart from a later one that reuses its pid."""

    pid: int
    start_time: int  # clock ticks after boot, /proc/<pid>/stat field 22


@dataclass(frozen=True)
class DaemonDirs:
    """Where one daemon's pipes and sockets (shared with its clients) and logs live,
    and the directory its MPS server shares with its clients as /dev/shm (`shm`: a
    daemon of the node is started in a mount namespace of its own with it there; a
    daemon in a pod of its own, driver/kube/mps_daemons.py, has it mounted)."""

    pipe: Path
    log: Path
    shm: Path | None = None

    @property
    def pid_file(self) -> Path:
        """The driver's copy of the daemon's pid, where no client can write it."""
        return self.log / DAEMON_PID_FILE


def process_start_time(pid: int) -> int | None:
    """The start time of process `pid`, None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    # fields[0] is field 3 (state); a zombie has exited.
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def is_running(daemon: DaemonId) -> bool:
    return process_start_time(daemon.pid) == daemon.start_time


def _told(pid: int, pipe: Path) -> bool:
    """Was process `pid` started with `pipe` as its CUDA_MPS_PIPE_DIRECTORY (as this
    module starts a daemon)? A claim's container sees the directory at its mount
    point, not at the host's path."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ.split(b"\0")


def _signal(daemon: DaemonId, signum: int) -> None:
    """Send `signum` to the daemon, not to a process that took its pid since."""
    try:
        pidfd = os.pidfd_open(daemon.pid)
    except OSError:
        return  # gone
    try:
        if is_running(daemon):  # the pidfd holds this very process from here on
            signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def find_binary(driver_root: Path) -> Path | None:
    """The driver root's `nvidia-cuda-mps-control`, in nvidia-smi's directories."""
    for directory in BINARY_DIRS:
        candidate = driver_root / directory / BINARY
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


class MpsControl:
    """`MpsOps` (driver/state/mps/claim_daemons.py) with the driver root's binary."""

    def __init__(self, driver_root: Path | str) -> None:
        self.driver_root = Path(driver_root)

    def available(self) -> bool:
        return find_binary(self.driver_root) is not None

    def _binary(self) -> Path:
        binary = find_binary(self.driver_root)
        if binary is None:
            raise transient(
                f"no executable {BINARY} under the driver root {self.driver_root} (looked in "
                + ", ".join(BINARY_DIRS)
                + "); MPS needs it"
            )
        return binary

    def _env(self, dirs: DaemonDirs, gpu_uuids: Sequence[str] = ()) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(dirs.pipe)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(dirs.log)
        if gpu_uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
        found = [str(self.driver_root / d) for d in LIBRARY_DIRS if (self.driver_root / d).is_dir()]
        if found and self.driver_root != Path("/"):
            env["LD_LIBRARY_PATH"] = ":".join(filter(None, [*found, env.get("LD_LIBRARY_PATH")]))
        return env

    def _run(self, argv: list[str], env: dict[str, str], stdin: str | None) -> str:
        try:
            proc = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=DEFAULT_TIMEOUT,
                env=env,
                check=False,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as err:
            raise transient(f"{argv[0]} did not finish in {DEFAULT_TIMEOUT:g}s") from err
        except OSError as err:
            raise transient(f"cannot run {argv[0]}: {err}") from err
        out = proc.stdout.strip()
        if proc.returncode != 0:
            detail = proc.stderr.strip() or out or "(no output)"
            raise transient(f"{argv[0]} exited with status {proc.returncode}: {detail}")
        return out

    def start(
        self, dirs: DaemonDirs, gpu_uuids: Sequence[str], *, multi_user: bool = False
    ) -> DaemonId:
        """Start a daemon for `gpu_uuids` on `dirs` (created here) and return it once
        its pid file names a running process. `multi_user`: `-M`, one server for
        clients of any uid (NVIDIA's `multiUser`; Volta and later)."""
        dirs.pipe.mkdir(parents=True, exist_ok=True)
        dirs.log.mkdir(parents=True, exist_ok=True)
        what = f"starting the MPS control daemon in {dirs.pipe}"
        argv = [str(self._binary()), "-d", *(["-M"] if multi_user else [])]
        if dirs.shm is not None:
            dirs.shm.mkdir(parents=True, exist_ok=True)
            argv = _with_shm(dirs.shm, argv)
        # Now in clock ticks after boot (a start time's unit), less a tick of rounding.
        launched = int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")) - 1
        try:
            self._run(argv, self._env(dirs, gpu_uuids), None)
        except Exception as err:
            raise transient(f"{what}: {err}") from err
        deadline = time.monotonic() + DEFAULT_TIMEOUT
        while True:
            daemon = self._started(dirs, launched)
            if daemon is not None:
                temp = dirs.pid_file.with_name(f".{DAEMON_PID_FILE}.{os.getpid()}")
                temp.write_text(f"{daemon.pid}\n")
                temp.replace(dirs.pid_file)
                log.info("MPS control daemon %d started in %s", daemon.pid, dirs.pipe)
                return daemon
            if time.monotonic() > deadline:
                raise transient(f"{what}: no running daemon wrote {dirs.pipe / PID_FILE}")
            time.sleep(_POLL)

    @staticmethod
    def _started(dirs: DaemonDirs, launched: int) -> DaemonId | None:
        """The daemon the pipe directory's pid file names, if it is one this start
        made: started since `launched`, told this pipe directory."""
        try:
            pid = int((dirs.pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        start = process_start_time(pid)
        if start is None or start < launched or not _told(pid, dirs.pipe):
            return None
        return DaemonId(pid, start)

    def running(self, dirs: DaemonDirs) -> DaemonId | None:
        """The daemon the driver's pid file in `dirs.log` names, if it is running.
        Without that file (a plugin killed while it started the daemon), the one the
        pipe directory's pid file names if it was told this pipe directory."""
        try:
            pid = int(dirs.pid_file.read_text().strip())
        except FileNotFoundError:
            return self._started(dirs, 0)
        except (OSError, ValueError):
            return None
        start = process_start_time(pid)
        return None if start is None else DaemonId(pid, start)

    def command(self, dirs: DaemonDirs, line: str) -> str:
        """One control command (`set_default_active_thread_percentage 50`); its answer."""
        try:
            return self._run([str(self._binary())], self._env(dirs), line + "\n")
        except Exception as err:
            raise transient(f"MPS control daemon in {dirs.pipe}: {line!r} failed: {err}") from err

    def stop(self, dirs: DaemonDirs, daemon: DaemonId | None) -> None:
        """`quit -t QUIT_TIMEOUT_SECONDS` the daemon and wait until it is gone. One
        that is not running (or another process that reuses its pid) counts as
        stopped. Without the binary (MPS turned off by removing it) the daemon is sent
        SIGTERM, then SIGKILL."""
        if daemon is None or not is_running(daemon):
            dirs.pid_file.unlink(missing_ok=True)
            return
        if find_binary(self.driver_root) is not None:
            self.command(dirs, f"quit -t {QUIT_TIMEOUT_SECONDS}")
        else:
            log.warning(
                "no %s under the driver root %s to quit the MPS control daemon %d: "
                "sending it SIGTERM",
                BINARY,
                self.driver_root,
                daemon.pid,
            )
            _signal(daemon, signal.SIGTERM)
            if not _gone(daemon):
                _signal(daemon, signal.SIGKILL)
        if not _gone(daemon):
            raise transient(
                f"the MPS control daemon {daemon.pid} in {dirs.pipe} did not quit "
                f"in {DEFAULT_TIMEOUT:g}s"
            )
        dirs.pid_file.unlink(missing_ok=True)
        log.info("MPS control daemon %d in %s stopped", daemon.pid, dirs.pipe)


def _gone(daemon: DaemonId) -> bool:
    """Whether the daemon is gone within DEFAULT_TIMEOUT."""
    deadline = time.monotonic() + DEFAULT_TIMEOUT
    while is_running(daemon):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL)
    return True


def _with_shm(shm: Path, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose /dev/shm is `shm`. An MPS server
    and its clients share memory through files in /dev/shm; a client in a container
    has the container's, so the daemon of a node gets the directory the claim's
    containers mount at /dev/shm (as a daemon's pod does). The daemon forks its
    server, which stays in that namespace. Needs CAP_SYS_ADMIN (a plugin on the node
    runs as root); util-linux's `unshare` and `mount` are on every node."""
    unshare = ["unshare", "--mount", "--propagation", "private", "--"]
    return [*unshare, "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', str(shm), *argv]
