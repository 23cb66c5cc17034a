"""The plugin's /status: on its root-only status socket in the data directory, not on
the pod-network HTTP port (which keeps /metrics, /healthz and /readyz)."""

from __future__ import annotations

import io
import json
import socket
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.cli import build_parser
from driver.cli.mock import submit
from driver.cli.plugin_endpoint import PluginUnreachable, fetch_status
from driver.kube.api import ApiError, KubeApi
from driver.nvml.mock.mock_control import MockRequest
from driver.observability.http_limits import Limits
from driver.observability.listeners import listen_unix
from driver.observability.status_socket import StatusSocketServer
from driver.plugin import main as plugin_main
from driver.plugin.options.flags import parse_options

NODE = "n1"
WAIT = 10.0


class UnreadyApi:
    """An API server that answers nothing: the plugin serves regardless."""

    writes = 0

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        raise ApiError(503, "Service Unavailable")

    def watch(self, path: str, **_: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        raise ApiError(503, "Service Unavailable")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return err.code


def gpu_dra_status(*argv: str) -> tuple[int, str]:
    args = build_parser().parse_args(["status", *argv])
    out = io.StringIO()
    return args.run(args, out=out), out.getvalue()


def test_the_plugin_answers_status_on_its_socket_and_not_on_its_port(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: /status (GPU UUIDs, PCI ids, Xid text, claims) was answered on the HTTP
    port, which every pod can reach, and nothing on the node could reach it."""
    monkeypatch.setattr(
        KubeApi, "from_kubeconfig", classmethod(lambda cls, path=None: UnreadyApi())
    )
    port = free_port()
    data_dir = short_dir / "plugins" / "gpu.example.com"
    options = parse_options(
        [
            f"--node-name={NODE}",
            "--nvml-backend=mock",
            f"--kubelet-plugins-directory-path={short_dir / 'plugins'}",
            f"--kubelet-registrar-directory-path={short_dir / 'registry'}",
            f"--cdi-root={short_dir / 'cdi'}",
            f"--http-port={port}",
        ]
    )
    plugin = plugin_main.Plugin(options, "9.9.9")
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(plugin.run())
        except BaseException as err:  # reported by the test thread
            outcome.append(err)

    thread = threading.Thread(target=run, name="plugin")
    thread.start()
    try:
        served = threading.Event()
        for _ in range(int(WAIT / 0.01)):  # the port answers once everything is served
            if outcome or served.wait(0.01):
                break
            try:
                http_get(port, "/metrics")
            except OSError:
                continue
            served.set()
        assert served.is_set(), outcome
        assert http_get(port, "/metrics") == 200 and http_get(port, "/healthz") in (200, 503)
        assert http_get(port, "/status") == 404

        socket_file = data_dir / "status.sock"
        mode = socket_file.lstat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        code, out = gpu_dra_status("--socket", str(socket_file), "-o", "json")
        report = json.loads(out)
        assert report["reachable"] is True and report["plugin"]["version"] == "9.9.9"
        assert report["plugin"]["node"] == NODE and len(report["gpus"]) == 8
        # Without --socket: the one in the data directory (--state-dir), as on the node.
        code, out = gpu_dra_status("--state-dir", str(data_dir))
        assert code == 0 and "plugin        version 9.9.9" in out, out
        # The plugin's control requests ride on the same socket: a mock Xid, applied by
        # its health monitor.
        assert submit(data_dir, MockRequest("xid", device="gpu-3", xid=79)).startswith(
            "Xid 79 on gpu-3"
        )
    finally:
        plugin.stopping.set()
        thread.join(4 * WAIT)
    assert outcome == [0], outcome
    assert not socket_file.exists()  # a clean stop removes it


def test_the_socket_answers_status_and_healthz_only(short_dir: Path) -> None:
    path = short_dir / "status.sock"
    with StatusSocketServer(path, lambda: {"gpus": []}, lambda: (True, "ok\n")).start():
        assert fetch_status(path) == {"gpus": []}
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(100).startswith(b"HTTP/1.1 404")
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(200).endswith(b"\r\n\r\nok\n")


def test_the_sockets_limits_close_an_idle_client(short_dir: Path) -> None:
    """The bounded server's deadline holds on the socket too: a client that sends
    nothing is closed, and one that asks is answered meanwhile."""
    path = short_dir / "status.sock"
    limits = Limits(timeout=0.5, max_connections=2, max_per_peer=2, workers=1)
    with StatusSocketServer(path, lambda: {"ok": True}, lambda: (True, "ok\n"), limits).start():
        idle = socket.socket(socket.AF_UNIX)
        idle.connect(str(path))
        idle.settimeout(WAIT)
        assert fetch_status(path) == {"ok": True}
        assert idle.recv(1) == b""  # closed at its deadline
        idle.close()


def test_a_stale_socket_is_replaced_and_a_newer_ones_is_left_at_stop(short_dir: Path) -> None:
    """A crash leaves its socket behind; during a rolling update the new pod's replaces
    the old one's, and the old pod's stop leaves the new one's in place."""
    path = short_dir / "status.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    old = StatusSocketServer(path, lambda: {"from": "old"}, lambda: (True, "ok\n")).start()
    assert fetch_status(path) == {"from": "old"}
    new = StatusSocketServer(path, lambda: {"from": "new"}, lambda: (True, "ok\n")).start()
    old.shutdown()
    assert fetch_status(path) == {"from": "new"}
    new.shutdown()
    assert not path.exists()
    assert [p.name for p in short_dir.iterdir()] == []  # no temporary names left


def test_a_file_in_the_sockets_way_is_named(short_dir: Path) -> None:
    path = short_dir / "status.sock"
    path.write_text("not a socket")
    with pytest.raises(ValueError, match=f"{path} exists and is not a socket: move it aside"):
        listen_unix(path)
    assert path.read_text() == "not a socket"


def test_a_socket_path_too_long_is_a_one_line_error(short_dir: Path) -> None:
    deep = short_dir / ("d" * 100)
    with pytest.raises(ValueError, match=r"is longer than \d+ bytes \(the Unix socket limit\)"):
        listen_unix(deep / "status.sock")


def test_the_cli_says_why_the_socket_does_not_answer(short_dir: Path) -> None:
    with pytest.raises(PluginUnreachable, match="no such socket"):
        fetch_status(short_dir / "status.sock")
    closed = short_dir / "closed.sock"
    listener = listen_unix(closed)
    listener.sock.close()  # a plugin killed without its cleanup: nothing listens
    with pytest.raises(PluginUnreachable, match="refused"):
        fetch_status(closed)
