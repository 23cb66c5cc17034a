"""The plugin's control requests on its status socket (`driver.health.control_queue`): what
the socket answers, and the hand-off to the health monitor's thread."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from driver.cli.plugin_endpoint import (
    ControlRefused,
    PluginUnreachable,
    exchange,
    fetch_control,
    post_control,
)
from driver.health.control_queue import ControlError, ControlQueue, NotTaken
from driver.observability.status_socket import LIMITS, StatusSocketServer
from tests.control_socket import control_socket

WAIT = 30.0  # only a regression waits this long


def echo(request: dict[str, Any]) -> dict[str, Any]:
    return {"message": f"echo {request['n']}", "action": request["action"]}


def refuse(request: dict[str, Any]) -> dict[str, Any]:
    raise ControlError("no such device")


def broken(request: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("a bug")


@pytest.fixture
def control() -> ControlQueue:
    queue = ControlQueue(node_name="node-1")
    queue.register("echo", echo)
    queue.register("refuse", refuse)
    queue.register("broken", broken)
    return queue


class Monitor:
    """The health monitor's side: polls `control` in a thread of its own."""

    def __init__(self, control: ControlQueue) -> None:
        self.control = control
        self.thread_name = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            if self.control.poll():
                self.thread_name = threading.current_thread().name

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(WAIT)


def post(path: Path, target: str, body: bytes) -> tuple[int, dict[str, Any]]:
    status, data = exchange(path, "POST", target, body, timeout=WAIT)
    return status, json.loads(data)


def test_a_request_is_applied_on_the_monitors_thread_and_answered(
    short_dir: Path, control: ControlQueue
) -> None:
    with control_socket(short_dir, control) as path, Monitor(control) as monitor:
        answer = post_control(path, "echo", {"n": 7, "action": "other"}, timeout=WAIT)
    assert answer == {"ok": True, "message": "echo 7", "action": "echo"}  # the path's action
    assert monitor.thread_name == "health-monitor"
    assert control.handled == 1


def test_get_control_describes_the_plugin(short_dir: Path, control: ControlQueue) -> None:
    with control_socket(short_dir, control) as path:
        described = fetch_control(path)
    assert described["node"] == "node-1" and isinstance(described["pid"], int)
    assert described["actions"] == ["broken", "echo", "refuse"]


def test_what_the_socket_answers_without_applying(short_dir: Path, control: ControlQueue) -> None:
    with control_socket(short_dir, control) as path, Monitor(control):
        status, answer = post(path, "/control/explode", b"{}")
        assert status == 404 and answer["ok"] is False
        assert answer["message"] == (
            "action 'explode' is not accepted by this plugin (it accepts: broken, echo, refuse)"
        )
        assert answer["actions"] == ["broken", "echo", "refuse"]
        assert post(path, "/control/echo", b"[1]") == (
            400,
            {"ok": False, "message": "malformed request: not a JSON object"},
        )
        status, answer = post(path, "/control/echo", b"{not json")
        assert status == 400 and answer["message"].startswith("malformed request")
        assert post(path, "/control/refuse", b"{}") == (
            422,
            {"ok": False, "message": "no such device"},
        )
        status, answer = post(path, "/control/broken", b"{}")
        assert status == 422 and answer["message"] == "the plugin failed to apply it: a bug"
        assert exchange(path, "GET", "/control/echo", timeout=WAIT)[0] == 405
        assert exchange(path, "POST", "/control", b"{}", timeout=WAIT)[0] == 405
    assert control.handled == 2  # refuse and broken reached their handlers; no others


def test_a_body_over_the_limit_is_refused_unread(short_dir: Path, control: ControlQueue) -> None:
    body = json.dumps({"n": "x" * LIMITS.max_body}).encode()
    with control_socket(short_dir, control) as path:
        status, data = exchange(path, "POST", "/control/echo", body, timeout=WAIT)
    assert status == 413 and b"too large" in data
    assert control.poll() == 0


def test_a_request_not_taken_in_time_is_withdrawn(short_dir: Path, control: ControlQueue) -> None:
    with control_socket(short_dir, control) as path:  # nobody polls
        start = time.monotonic()
        with pytest.raises(ControlRefused, match=r"within 0\.2s; request withdrawn") as refused:
            post_control(path, "echo", {"n": 1}, timeout=0.2)
        assert time.monotonic() - start < WAIT / 2
    assert refused.value.status == 503
    assert control.poll() == 0  # nothing left to apply later


def test_the_take_timeout_is_bounded(control: ControlQueue) -> None:
    from driver.health.control_queue import MAX_TAKE_SECONDS, _take_timeout

    assert _take_timeout("/control/echo") == 5.0
    assert _take_timeout("/control/echo?timeout=0.5") == 0.5
    assert _take_timeout("/control/echo?timeout=1e9") == MAX_TAKE_SECONDS
    assert _take_timeout("/control/echo?timeout=-3") == 0.0
    assert _take_timeout("/control/echo?timeout=nan") == 0.0
    assert _take_timeout("/control/echo?timeout=soon") == 5.0


def test_a_stopping_monitor_refuses_what_is_pending_and_what_comes(control: ControlQueue) -> None:
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            control.submit("echo", {"action": "echo", "n": 1}, timeout=WAIT)
        except NotTaken as err:
            outcome.append(err)

    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not control._pending:  # queued
        assert time.monotonic() < deadline
        time.sleep(0.001)
    control.close()
    thread.join(WAIT)
    assert [str(e) for e in outcome] == ["the plugin is stopping"]
    with pytest.raises(NotTaken, match="stopping"):
        control.submit("echo", {"action": "echo", "n": 2}, timeout=WAIT)


def test_the_cli_says_a_plugin_predates_control_requests(short_dir: Path) -> None:
    path = short_dir / "status.sock"
    with StatusSocketServer(path, dict, lambda: (True, "ok\n")).start():  # no control
        with pytest.raises(PluginUnreachable, match="predates control requests"):
            fetch_control(path)
        with pytest.raises(ControlRefused, match="predates them") as refused:
            post_control(path, "clear", {"device": "gpu-0"})
    assert refused.value.status == 404


def test_a_plugin_that_only_gets_is_named_too(short_dir: Path) -> None:
    """The status socket of a release before control requests answered POST with 405."""
    path = short_dir / "status.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()

    def old_plugin() -> None:
        conn, _ = listener.accept()
        with conn:
            # The whole request (http.client sends the head and the body apart): a close
            # with the body unsent would fail the client's send with EPIPE first.
            request = chunk = b""
            while not request.endswith(b"}") and (chunk := conn.recv(65536)):
                request += chunk
            conn.sendall(
                b"HTTP/1.1 405 Method Not Allowed\r\nContent-Type: text/plain\r\n"
                b"Allow: GET, HEAD\r\nContent-Length: 9\r\nConnection: close\r\n\r\nGET only\n"
            )

    thread = threading.Thread(target=old_plugin, daemon=True)
    thread.start()
    with pytest.raises(ControlRefused, match=r"\(HTTP 405\) does not take control requests"):
        post_control(path, "xid", {"device": "gpu-0", "xid": 79}, timeout=WAIT)
    thread.join(WAIT)
    listener.close()
