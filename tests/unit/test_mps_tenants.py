"""MPS for tenants that do not run as root (issue 44, item 5; docs/mps.md,
"Directories, users and /dev/shm"). The MPS control daemon runs as root, but the MPS
server it starts for a client runs as the client's uid, and a claim's container may
run as any uid (`runAsUser: 1000`). So a daemon's `pipe/` and `shm/` are 1777 (every
uid makes its sockets and files there; the sticky bit keeps one uid from removing or
replacing another's, the daemon's pid file included); the MPS root and the device's
directory 0711 (searched on the way, never listed); and `log/`, where the driver keeps
its copy of the daemon's pid, root's 0755: a client reaches it, writes nothing there.

The uid-1000 checks run in a child process that drops to that uid, with the
directories opened beforehand, as a container's bind mounts of them would give them
(the host's parents of a bind-mounted directory play no part in the container)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from driver.nvml.mps import DAEMON_PID_FILE, PID_FILE
from driver.state.mps.daemons import daemon_dirs, unsearchable_parent
from tests.unit.test_mps_prepare import Node, mps_node, ok
from tests.unit.test_mps_watch import kill

TENANT = 1000
OTHER_TENANT = 1001


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path)


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.lstat(path).st_mode))


def _as_uid(uid: int, check: Callable[[], int]) -> int:
    """`check()` in a child that runs as `uid` (no capabilities); its return value
    (0..255) as the child's exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        status = 99
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            status = check()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _errno_of(call: Callable[[], object]) -> int:
    try:
        call()
    except OSError as err:
        return err.errno
    return 0


def test_the_daemons_directories_let_any_uid_reach_pipe_and_shm_and_keep_the_pid_file_roots(
    node: Node,
) -> None:
    ok(node.state(), node.claims.add("a"))
    record = node.record("a")
    root = node.root / "plugin" / "mps"
    dirs = daemon_dirs(root, record)
    assert dirs.shm is not None
    modes = {
        "root": _mode(root),
        "device": _mode(dirs.pipe.parent),
        "pipe": _mode(dirs.pipe),
        "log": _mode(dirs.log),
        "shm": _mode(dirs.shm),
    }
    assert modes == {
        "root": "0o711",
        "device": "0o711",
        "pipe": "0o1777",
        "log": "0o755",
        "shm": "0o1777",
    }
    for directory in (root, dirs.pipe.parent, dirs.pipe, dirs.log, dirs.shm):
        assert os.lstat(directory).st_uid == os.geteuid(), directory
    # The driver's copy of the daemon's pid: in log/, which only root may write.
    pid_file = dirs.log / DAEMON_PID_FILE
    assert int(pid_file.read_text()) == record.pid
    assert os.lstat(pid_file).st_uid == os.geteuid()
    assert not os.lstat(pid_file).st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_client_of_uid_1000_writes_its_shm_and_pipe_but_not_the_log_or_anothers_files(
    node: Node,
) -> None:
    ok(node.state(), node.claims.add("a"))
    record = node.record("a")
    dirs = daemon_dirs(node.root / "plugin" / "mps", record)
    assert dirs.shm is not None
    fds = {
        name: os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        for name, path in (("pipe", dirs.pipe), ("log", dirs.log), ("shm", dirs.shm))
    }
    try:
        pipe, log, shm = fds["pipe"], fds["log"], fds["shm"]
        create = os.O_CREAT | os.O_WRONLY
        # (the errno each call must end with, 0 for none; the call)
        checks: list[tuple[int, Callable[[], object]]] = [
            # /dev/shm: the client's shared memory files
            (0, lambda: os.close(os.open("client", create, 0o600, dir_fd=shm))),
            # /tmp/nvidia-mps: what the client and its server make there
            (0, lambda: os.mkdir("server", dir_fd=pipe)),
            (0, lambda: os.stat(PID_FILE, dir_fd=pipe)),  # the daemon is seen
            # the daemon's own files there, root's: neither removed nor replaced
            (errno.EPERM, lambda: os.unlink(PID_FILE, dir_fd=pipe)),
            (errno.EPERM, lambda: os.rename("server", PID_FILE, src_dir_fd=pipe, dst_dir_fd=pipe)),
            # log/: searched (the server's uid reaches it), never written
            (0, lambda: os.stat(DAEMON_PID_FILE, dir_fd=log)),
            (errno.EACCES, lambda: os.open(DAEMON_PID_FILE, os.O_WRONLY, dir_fd=log)),
            (errno.EACCES, lambda: os.open("x", create, 0o600, dir_fd=log)),
        ]

        def tenant() -> int:
            """0 where every check holds, else the number of the first that failed."""
            for number, (expected, call) in enumerate(checks, 1):
                if _errno_of(call) != expected:
                    return number
            return 0

        assert _as_uid(TENANT, tenant) == 0

        def other_tenant() -> int:
            """Another uid of the same claim cannot remove the first one's files."""
            gone = _errno_of(lambda: os.unlink("client", dir_fd=fds["shm"]))
            return 0 if gone == errno.EPERM else 1

        assert _as_uid(OTHER_TENANT, other_tenant) == 0
        assert os.lstat(dirs.shm / "client").st_uid == TENANT
    finally:
        for fd in fds.values():
            os.close(fd)


def test_a_revived_daemon_gets_the_modes_a_directory_from_an_older_release_lacks(
    node: Node,
) -> None:
    """Directories an older release made (0755, root's) are given their modes when
    their daemon is started again (at the plugin's start after an upgrade)."""
    ok(node.state(), node.claims.add("a"))
    record = node.record("a")
    dirs = daemon_dirs(node.root / "plugin" / "mps", record)
    assert dirs.shm is not None
    for directory in (dirs.pipe, dirs.shm):
        directory.chmod(0o755)
    kill(record)  # and wait until it is gone: a signal is not yet an exit

    node.state()

    assert node.report.mps_lost == ("a",)
    assert (_mode(dirs.pipe), _mode(dirs.shm)) == ("0o1777", "0o1777")


def test_a_node_daemon_says_when_its_server_could_not_reach_the_pipe_for_a_non_root_client(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """With --mps-daemons=node the server opens its pipe directory by the host's path:
    a data directory of 0750 (the plugin's) stops a non-root server on its way."""
    with caplog.at_level(logging.WARNING, logger="driver.state.mps.claim_daemons"):
        ok(node.state(), node.claims.add("a"))
    data_dir = node.root / "plugin"
    assert _mode(data_dir) == "0o750"
    assert f"{data_dir} is not searchable by other users" in caplog.text, caplog.text
    assert unsearchable_parent(data_dir / "mps") == data_dir
    assert unsearchable_parent(Path("/proc/mps")) is None
