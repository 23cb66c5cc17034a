"""The plugin's control requests: `gpu-dra` asks the running plugin, which applies the
request on its health monitor's thread and answers, so `gpu-dra` never changes a running
plugin's state behind its back (docs/health.md, "Mock control", its transport).

The plugin's status socket (`driver.observability.status_socket`: HTTP on a Unix socket
in its data directory, mode 0600, so root on the node only) hands these paths to
`ControlQueue.respond`:

- `GET /control`: the plugin (`pid`, `node`, `started`) and the `actions` it accepts.
- `POST /control/<action>[?timeout=<seconds>]`, a JSON object as the body (at most
  64 KiB: the status socket's `max_body`): the request. The answer is a JSON object
  with `ok` and `message`, plus what the action adds: 200 applied; 400 not a JSON
  object; 404 an action this plugin does not accept (with `actions`); 422 refused by
  the action (the message says why); 503 not taken by the health monitor within
  `timeout` seconds (default 5, at most 30): withdrawn, nothing applied.

The health monitor's thread takes a request (`ControlQueue.submit`) on its next `poll()`,
before every NVML event wait. It is the only writer of the health store, so nothing
changes between a `clear`'s plan and the clear. Actions: `clear` (`driver.health.clear`),
and those the NVML backend adds (`NvmlBackend.control_actions`: the mock's).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from driver.observability.http_messages import Request, Response

log = logging.getLogger(__name__)

PATH: Final = "/control"
DEFAULT_TAKE_SECONDS: Final = 5.0
MAX_TAKE_SECONDS: Final = 30.0
# Taken requests are answered once applied: a handler returns within seconds (`clear`
# waits at most its publish timeout). Past this, the answer is given up on.
MAX_ANSWER_SECONDS: Final = 60.0


class ControlError(Exception):
    """A request that was refused or not applied; the message says why."""


class UnknownAction(ControlError):
    """An action this plugin does not accept."""


class NotTaken(ControlError):
    """The health monitor did not take the request in time (withdrawn) or answer it."""


Handler = Callable[[dict[str, Any]], dict[str, Any]]
"""Applies one request (the parsed JSON object) and returns the answer's fields
beyond `ok` (at least `message`); raises ControlError to refuse it."""


@dataclass(eq=False)
class _Pending:
    handler: Handler
    request: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False
    answer: dict[str, Any] | None = None
    refusal: ControlError | None = None


class ControlQueue:
    """Control requests from the status socket's worker to the health monitor's thread:
    `register` the actions, `submit` (any thread), `poll` (the monitor), `close`."""

    def __init__(self, *, node_name: str = "") -> None:
        self._node = node_name
        self._started = time.time()
        self._handlers: dict[str, Handler] = {}
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.handled = 0

    def register(self, action: str, handler: Handler) -> None:
        if action in self._handlers:
            raise ValueError(f"control action {action!r} registered twice")
        self._handlers[action] = handler

    def register_all(self, handlers: Mapping[str, Handler]) -> None:
        for action, handler in handlers.items():
            self.register(action, handler)

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(sorted(self._handlers))

    # -- the status socket's side ----------------------------------------------------

    def submit(
        self, action: str, request: dict[str, Any], *, timeout: float = DEFAULT_TAKE_SECONDS
    ) -> dict[str, Any]:
        """The answer (`ok` true) once the monitor applied the request. Raises
        UnknownAction, ControlError (the action refused it) or NotTaken."""
        handler = self._handlers.get(action)
        if handler is None:
            raise UnknownAction(
                f"action {action!r} is not accepted by this plugin "
                f"(it accepts: {', '.join(self.actions) or 'none'})"
            )
        pending = _Pending(handler, request)
        with self._lock:
            if self._closed:
                raise NotTaken("the plugin is stopping")
            self._pending.append(pending)
        if not pending.done.wait(timeout):
            with self._lock:
                if not pending.taken:
                    self._pending.remove(pending)
                    raise NotTaken(
                        f"the health monitor did not take the request within {timeout:g}s; "
                        "request withdrawn"
                    )
            if not pending.done.wait(MAX_ANSWER_SECONDS):
                raise NotTaken(
                    "the health monitor took the request but did not answer within "
                    f"{MAX_ANSWER_SECONDS:.0f}s: its outcome is unknown"
                )
        if pending.refusal is not None:
            raise pending.refusal
        assert pending.answer is not None
        return {"ok": True, **pending.answer}

    # -- the health monitor's side ---------------------------------------------------

    def poll(self) -> int:
        """Apply every pending request, in order; how many were applied."""
        count = 0
        while True:
            with self._lock:
                if not self._pending:
                    break
                pending = self._pending.popleft()
                pending.taken = True
            try:
                pending.answer = pending.handler(pending.request)
            except ControlError as err:
                log.warning("control: refused %s: %s", pending.request.get("action"), err)
                pending.refusal = err
            except Exception as err:  # a bug: answered, and the monitor goes on
                log.exception("control: %s failed", pending.request.get("action"))
                pending.refusal = ControlError(f"the plugin failed to apply it: {err}")
            pending.done.set()
            count += 1
        self.handled += count
        return count

    def close(self) -> None:
        """Refuse what is pending and every later request (the monitor stops)."""
        with self._lock:
            self._closed = True
            while self._pending:
                pending = self._pending.popleft()
                pending.taken = True
                pending.refusal = NotTaken("the plugin is stopping")
                pending.done.set()

    # -- HTTP ------------------------------------------------------------------------

    def respond(self, request: Request) -> Response:
        """`GET /control` and `POST /control/<action>` (the module docstring)."""
        if request.path == PATH:
            if request.method not in ("GET", "HEAD"):
                return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", allow="GET, HEAD")
            plugin = {"pid": os.getpid(), "node": self._node, "started": self._started}
            return _json(HTTPStatus.OK, {**plugin, "actions": list(self.actions)})
        if request.method != "POST":
            return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"POST only\n", allow="POST")
        action = request.path.removeprefix(PATH + "/")
        try:
            doc = json.loads(request.body)
        except ValueError as err:
            return _refusal(HTTPStatus.BAD_REQUEST, f"malformed request: {err}")
        if not isinstance(doc, dict):
            return _refusal(HTTPStatus.BAD_REQUEST, "malformed request: not a JSON object")
        doc["action"] = action
        try:
            answer = self.submit(action, doc, timeout=_take_timeout(request.target))
        except UnknownAction as err:
            return _refusal(HTTPStatus.NOT_FOUND, str(err), actions=list(self.actions))
        except NotTaken as err:
            return _refusal(HTTPStatus.SERVICE_UNAVAILABLE, str(err))
        except ControlError as err:
            return _refusal(HTTPStatus.UNPROCESSABLE_ENTITY, str(err))
        return _json(HTTPStatus.OK, answer)


def _take_timeout(target: str) -> float:
    """`?timeout=<seconds>` (how long the client waits), within 0..MAX_TAKE_SECONDS."""
    given = parse_qs(urlsplit(target).query).get("timeout")
    try:
        seconds = float(given[0]) if given else DEFAULT_TAKE_SECONDS
    except ValueError:
        seconds = DEFAULT_TAKE_SECONDS
    return min(max(seconds, 0.0), MAX_TAKE_SECONDS) if seconds == seconds else 0.0


def _json(status: HTTPStatus, doc: dict[str, Any]) -> Response:
    return Response(status, json.dumps(doc).encode() + b"\n", "application/json")


def _refusal(status: HTTPStatus, message: str, **more: Any) -> Response:
    return _json(status, {"ok": False, "message": message, **more})
