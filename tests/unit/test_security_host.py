"""What a hostile file in the plugin's directories cannot do: stall the health
monitor through the control spool, make a lock or a socket chmod act on the file a
symlink names, or make the CLI write or wait where it should not (security review,
host side)."""

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
from driver.health.control import ControlChannel, ControlError, deliver, spool_dir
from driver.health.monitor import HealthMonitor
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.nvml.types import HealthEvent
from driver.plugin.instances import InstanceLock
from driver.plugin.serving import BuiltServer, SocketServer, new_server
from driver.state.checkpoint import CHECKPOINT_FILE
from driver.state.locking import SerializeLock

GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
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


# -- the control spool ---------------------------------------------------------------


class OneEvent:
    """An NVML event source that reports one Xid, then nothing."""

    def __init__(self, event: HealthEvent) -> None:
        self.events = [event]

    def open_event_set(self) -> None:
        pass

    def wait_event(self, timeout_ms: int) -> HealthEvent | None:
        return self.events.pop() if self.events else None

    def close_event_set(self) -> None:
        pass


def test_fifo_request_never_stalls_the_health_monitor(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    monitor = HealthMonitor(
        OneEvent(HealthEvent(GPU0, "xid", xid=79, message="Xid 79")),
        store,
        XidPolicy.from_flags(additional_ignored="", fatal=""),
        None,
        data_dir=tmp_path,
    )
    assert monitor.control is not None
    monitor.control.activate()
    fifo = spool_dir(tmp_path) / f"req-{'ab' * 8}.json"
    os.mkfifo(fifo, 0o600)
    try:
        assert finishes(monitor.run_once, fifo)  # polls the spool first
        assert store.gpu_failure(GPU0) is not None  # the Xid was recorded
        answer = json.loads((spool_dir(tmp_path) / f"res-{'ab' * 8}.json").read_text())
        assert answer["ok"] is False and "not a regular file" in answer["message"]
        assert not fifo.exists()
    finally:
        monitor.control.close()


def test_cli_never_writes_through_a_symlinked_spool(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    plugin = ControlChannel(elsewhere)  # a live marker, but in another directory
    plugin.register("clear", lambda request: {"message": "applied"})
    plugin.activate()
    state = tmp_path / "state"
    state.mkdir()
    spool_dir(state).symlink_to(spool_dir(elsewhere))
    with pytest.raises(ControlError, match="symbolic link"):
        deliver(state, {"action": "clear", "device": "gpu-0"}, timeout=0.3)
    assert sorted(os.listdir(spool_dir(elsewhere))) == ["ACTIVE"]


def test_cli_never_waits_on_a_fifo_marker(tmp_path: Path) -> None:
    spool = spool_dir(tmp_path)
    spool.mkdir(mode=0o700)
    marker = spool / "ACTIVE"
    os.mkfifo(marker, 0o600)
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            deliver(tmp_path, {"action": "clear", "device": "gpu-0"}, timeout=0.3)
        except ControlError as err:
            outcome.append(err)

    assert finishes(ask, marker)
    assert outcome and "not a regular file" in str(outcome[0])


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
