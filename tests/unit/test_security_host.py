"""What a hostile file in the plugin's directories cannot do: make a lock or a socket
chmod act on the file a symlink names, or make the CLI write or wait where it should
not (security review, host side). Control requests no longer pass through files: they
are POSTs on the root-only status socket (tests/unit/test_control_requests.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import grpc
import pytest

from driver.cli import build_parser
from driver.errors import DriverError
from driver.plugin.serving_instance import InstanceLock
from driver.plugin.transport.serving import BuiltServer, SocketServer, new_server
from driver.state.journal.checkpoint import CHECKPOINT_FILE
from driver.state.journal.locking import SerializeLock

# Seconds to wait for work that never waits on a FIFO to return: it returns at once,
# one stuck opening a FIFO never does (until a writer comes), however busy the machine.
EVENT_WAIT = 30.0


def finishes(work: Callable[[], object], unblock: Path) -> bool:
    """Run `work` in a thread; whether it returned (within EVENT_WAIT). A thread stuck
    opening the FIFO `unblock` for reading is released afterwards (a writer opens it)."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(EVENT_WAIT)
    stuck = thread.is_alive()
    if stuck:
        with contextlib.suppress(OSError):
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(EVENT_WAIT)
    return not stuck


# -- lock files ------------------------------------------------------------------------


def test_serialize_lock_never_follows_a_symlink(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    victim = tmp_path / "created-elsewhere"
    (data / "serialize.lock").symlink_to(victim)
    with pytest.raises(DriverError, match="symbolic link"), SerializeLock(data).hold():
        pass
    assert not victim.exists()  # O_CREAT through the link would have made it


def test_instance_lock_never_follows_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "created-elsewhere"
    (tmp_path / "instances.lock").symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link"):
        InstanceLock(tmp_path)
    assert not victim.exists()


def test_journal_show_never_waits_on_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / CHECKPOINT_FILE
    os.mkfifo(fifo, 0o600)
    result: list[tuple[int, str, str]] = []
    show = ["journal", "show", "--state-dir", str(tmp_path), "-o", "json"]
    assert finishes(lambda: result.append(gpu_dra(show)), fifo)
    code, out, _ = result[0]
    assert code == 1 and json.loads(out)["status"] == "corrupt"


def gpu_dra(argv: list[str]) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    code = args.run(args, out=out, err=err)
    return int(code), out.getvalue(), err.getvalue()


# -- sockets ---------------------------------------------------------------------------


class SwapAfterBind:
    """A gRPC server that, once bound, replaces its socket file with a symlink to
    `victim` (what a racing process could do) and remembers the socket's mode."""

    def __init__(self, path: Path, victim: Path) -> None:
        self._server = new_server(max_workers=1)
        self._path = path
        self._victim = victim
        self.mode_at_bind: int | None = None

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def start(self) -> None:
        self.mode_at_bind = stat.S_IMODE(os.lstat(self._path).st_mode)
        os.unlink(self._path)
        self._path.symlink_to(self._victim)
        self._server.start()

    def stop(self, grace: float | None) -> grpc.Future:
        return self._server.stop(grace)


@pytest.fixture
def swapped(tmp_path: Path) -> Iterator[tuple[SocketServer, SwapAfterBind, Path]]:
    victim = tmp_path / "victim"
    victim.write_text("x")
    victim.chmod(0o644)
    path = tmp_path / "dra.sock"
    server = SwapAfterBind(path, victim)
    socket_server = SocketServer("service", path, lambda: BuiltServer(cast(grpc.Server, server)))
    yield socket_server, server, victim
    socket_server.stop(0)


def test_socket_is_private_from_its_bind_and_never_chmods_a_link(
    swapped: tuple[SocketServer, SwapAfterBind, Path],
) -> None:
    socket_server, server, victim = swapped
    previous = os.umask(0o022)
    try:
        socket_server.start()
        assert os.umask(0o022) == 0o022  # the umask is restored
    finally:
        os.umask(previous)
    assert server.mode_at_bind == 0o600
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644  # the link's target untouched
