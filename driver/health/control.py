"""The plugin's control channel: requests from `gpu-dra` to the running plugin.

`gpu-dra` never changes a running plugin's state behind its back: it asks the
plugin, which applies the request itself and answers. Transport: a root-only spool
directory `<state-dir>/mock-control/` (0700, files 0600; the name is historical: the
channel first served only the mock backend's `gpu-dra mock ...`).

- The plugin creates it, writes `ACTIVE` (JSON: pid, node, start time, and
  `actions`: the actions this plugin accepts) and touches that file at least every
  second while it polls (`ControlChannel.poll`, run by the health monitor on every
  event wait, i.e. every <=100 ms).
- The CLI (`deliver`) refuses to write a request unless `ACTIVE` is fresh and lists
  the action, then writes `req-<id>.json` atomically (a dot-prefixed temp file
  renamed into place) and waits for the plugin's answer `res-<id>.json`, which it
  removes. A request the plugin did not answer in time is withdrawn. Requests and
  answers are not fsynced: a plugin drops what the spool holds when it starts, so
  after a crash there is nothing to recover, and an fsync would only delay a
  `gpu-dra mock xid` on its way to the event wait.
- Actions: `clear` (`gpu-dra health clear`, every backend), and with the mock backend
  only `xid`, `lost`, `reset` (`gpu-dra mock ...`). An `ACTIVE` without `actions` is
  from a plugin that predates the list: it served the mock actions only.

A request is a JSON object with at least `action`; the answer has `ok` and `message`
plus what the action adds.

Nothing in the spool is trusted to be what its name says. The plugin opens a
request with `O_NOFOLLOW | O_NONBLOCK` and answers anything but a regular file owned
by root with a refusal (a FIFO named `req-<id>.json` would otherwise block the health
monitor's thread, and new Xids would stop being tainted). The CLI writes only into a
spool that is a real directory (not a symlink) owned by root and closed to others,
and reads the marker and the answer without following a symlink or blocking.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.state.fileio import (
    UnsafeFileError,
    atomic_write,
    permission_denied,
    read_file_nofollow,
)

log = logging.getLogger(__name__)

SPOOL_NAME = "mock-control"
ACTIVE_NAME = "ACTIVE"
HEARTBEAT_SECONDS = 1.0
STALE_AFTER_SECONDS = 10.0
MAX_REQUEST_BYTES = 4096
# What a plugin whose ACTIVE marker lists no actions accepts (it served the mock only).
LEGACY_ACTIONS = ("xid", "lost", "reset")

_REQUEST_RE = re.compile(r"^req-([0-9a-f]{16,64})\.json$")


class ControlError(Exception):
    """A request that cannot be delivered or was refused; the message says why."""


Handler = Callable[[dict[str, Any]], dict[str, Any]]
"""Applies one request (the parsed JSON object) and returns the answer's fields
beyond `ok` (at least `message`); raises ControlError to refuse it."""


def spool_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / SPOOL_NAME


# -- plugin side ---------------------------------------------------------------------


class ControlChannel:
    """Consumes the spool in the plugin. `register` the actions, then `activate()`
    once, `poll()` often, `close()` on shutdown."""

    def __init__(self, state_dir: str | Path, *, node_name: str = "") -> None:
        self.dir = spool_dir(state_dir)
        self._node = node_name
        self._handlers: dict[str, Handler] = {}
        self._last_beat = 0.0
        self._active = False
        self.handled = 0

    def register(self, action: str, handler: Handler) -> None:
        if action in self._handlers:
            raise ValueError(f"control action {action!r} registered twice")
        self._handlers[action] = handler

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(sorted(self._handlers))

    def activate(self) -> None:
        """Create the spool (root-only) and announce this plugin in `ACTIVE`."""
        self.dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.dir.mkdir(mode=0o700)
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ControlError(f"{self.dir} is not a directory owned by uid {os.geteuid()}")
        os.chmod(self.dir, 0o700)
        # Requests left by a previous plugin instance are stale: drop them.
        for entry in os.listdir(self.dir):
            if entry.startswith(("req-", "res-", ".")):
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / entry)
        marker = {
            "pid": os.getpid(),
            "node": self._node,
            "started": time.time(),
            "actions": list(self.actions),
        }
        atomic_write(self.dir / ACTIVE_NAME, json.dumps(marker).encode(), mode=0o600)
        self._last_beat = time.monotonic()
        self._active = True
        log.info("control channel active at %s (actions: %s)", self.dir, ", ".join(self.actions))

    def close(self) -> None:
        if self._active:
            self._active = False
            with contextlib.suppress(OSError):
                os.unlink(self.dir / ACTIVE_NAME)

    def poll(self) -> int:
        """Handle every pending request; returns how many were handled."""
        if not self._active:
            return 0
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_SECONDS:
            self._last_beat = now
            try:
                os.utime(self.dir / ACTIVE_NAME, follow_symlinks=False)
            except FileNotFoundError:
                log.warning("control channel: %s vanished; recreating it", self.dir / ACTIVE_NAME)
                self.activate()
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            self.activate()
            return 0
        count = 0
        for name in names:
            match = _REQUEST_RE.match(name)
            if match is None:
                continue
            answer = self._handle_file(self.dir / name)
            with contextlib.suppress(OSError):
                os.unlink(self.dir / name)
            try:
                atomic_write(
                    self.dir / f"res-{match.group(1)}.json",
                    json.dumps(answer).encode(),
                    mode=0o600,
                    durable=False,
                )
            except OSError as err:
                log.error("control channel: cannot answer %s: %s", name, err)
            count += 1
        self.handled += count
        return count

    def _handle_file(self, path: Path) -> dict[str, Any]:
        try:
            request = _read_request(path)
            action = request.get("action")
            handler = self._handlers.get(str(action))
            if handler is None:
                if action in LEGACY_ACTIONS or action == "clear":
                    raise ControlError(
                        f"action {action!r} is not accepted by this plugin "
                        f"(it accepts: {', '.join(self.actions) or 'none'})"
                    )
                raise ControlError(f"unknown action {action!r}")
            answer = handler(request)
        except (ControlError, OSError) as err:
            log.warning("control channel: refused %s: %s", path.name, err)
            return {"ok": False, "message": str(err)}
        return {"ok": True, **answer}


def _read_request(path: Path) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ControlError("request file is not a regular file owned by root")
        data = os.read(fd, MAX_REQUEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_REQUEST_BYTES:
        raise ControlError("request too large")
    return _json_object(data, "malformed request")


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise ControlError(f"{what}: {err}") from None
    if not isinstance(doc, dict):
        raise ControlError(f"{what}: not an object")
    return doc


# -- CLI side ------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginMarker:
    """The running plugin, as its `ACTIVE` marker announces it."""

    pid: int | None
    node: str
    started: float | None
    actions: tuple[str, ...]
    lists_actions: bool  # False: a plugin that predates the list (mock actions only)

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "node": self.node,
            "started": self.started,
            "actions": list(self.actions),
        }


def check_spool(directory: Path) -> None:
    """ControlError unless `directory` is the spool a plugin made: a directory itself
    (not a symlink to one), owned by this user, writable by nobody else."""
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise ControlError(f"{directory} is a symbolic link; refusing to use it")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ControlError(
            f"{directory} is not a directory owned by uid {os.geteuid()} and closed to "
            "others; refusing to use it"
        )


def check_active(
    state_dir: str | Path, *, now: float | None = None, wanted: str = "kubelet plugin"
) -> PluginMarker:
    """The `ACTIVE` marker of a live plugin consuming the spool, or ControlError.
    `wanted` names the plugin the caller needs, for the message."""
    directory = spool_dir(state_dir)
    marker = directory / ACTIVE_NAME
    try:
        check_spool(directory)
        st = os.lstat(marker)
        doc = json.loads(read_file_nofollow(marker))
    except FileNotFoundError:
        raise ControlError(
            f"no {wanted} is consuming {directory} (no {ACTIVE_NAME} marker). Run this "
            "inside the plugin's pod (kubectl exec), or pass --state-dir with the "
            "plugin's data directory"
        ) from None
    except PermissionError:
        raise ControlError(permission_denied(directory)) from None
    except UnsafeFileError as err:
        raise ControlError(f"cannot read {marker}: {err.strerror}") from None
    except (OSError, ValueError) as err:
        raise ControlError(f"cannot read {marker}: {err}") from None
    if not isinstance(doc, dict):
        raise ControlError(f"cannot read {marker}: not a JSON object")
    age = (time.time() if now is None else now) - st.st_mtime
    if age > STALE_AFTER_SECONDS:
        raise ControlError(
            f"the plugin that owned {directory} (pid {doc.get('pid', '?')}) is not running: "
            f"its {ACTIVE_NAME} marker is {age:.0f}s old"
        )
    listed = doc.get("actions")
    lists_actions = isinstance(listed, list)
    pid, started = doc.get("pid"), doc.get("started")
    return PluginMarker(
        pid=pid if isinstance(pid, int) else None,
        node=str(doc.get("node", "")),
        started=float(started) if isinstance(started, int | float) else None,
        actions=tuple(str(a) for a in listed) if isinstance(listed, list) else LEGACY_ACTIONS,
        lists_actions=lists_actions,
    )


def require_action(marker: PluginMarker, action: str, *, why: str = "") -> None:
    """ControlError unless the running plugin accepts `action`."""
    if action in marker.actions:
        return
    pid = marker.pid if marker.pid is not None else "?"
    if not marker.lists_actions:
        detail = "it predates this command (upgrade the driver on this node)"
    else:
        detail = f"it accepts: {', '.join(marker.actions) or 'none'}"
    raise ControlError(f"the running plugin (pid {pid}) does not accept {action!r}{why}: {detail}")


def deliver(
    state_dir: str | Path,
    request: dict[str, Any],
    *,
    timeout: float,
    marker: PluginMarker | None = None,
    wanted: str = "kubelet plugin",
) -> dict[str, Any]:
    """Deliver `request` to the running plugin and return its answer (`ok` may be
    False: the plugin refused). Raises ControlError when no plugin that accepts the
    action consumes the spool, or it did not answer within `timeout` seconds (the
    request is then withdrawn; it may have been applied if the plugin took it just
    before the withdrawal: the message says so)."""
    action = str(request.get("action"))
    if marker is None:
        marker = check_active(state_dir, wanted=wanted)
    require_action(marker, action)
    directory = spool_dir(state_dir)
    try:
        check_spool(directory)
    except OSError as err:
        raise ControlError(f"cannot use {directory}: {err}") from None
    ident = f"{time.time_ns():016x}{secrets.token_hex(4)}"
    req = directory / f"req-{ident}.json"
    res = directory / f"res-{ident}.json"
    try:
        atomic_write(req, json.dumps(request).encode(), mode=0o600, durable=False)
    except PermissionError:
        raise ControlError(permission_denied(directory)) from None
    except OSError as err:
        raise ControlError(f"cannot write {req}: {err}") from None
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = read_file_nofollow(res)
            break
        except FileNotFoundError:
            pass
        except UnsafeFileError as err:
            raise ControlError(f"cannot read the plugin's answer {res}: {err.strerror}") from None
        if time.monotonic() >= deadline:
            try:
                os.unlink(req)
            except FileNotFoundError:
                taken = " (it had taken the request: its outcome is unknown)"
            else:
                taken = "; request withdrawn"
            raise ControlError(
                f"the plugin (pid {marker.pid if marker.pid is not None else '?'}) did not "
                f"answer within {timeout:.0f}s{taken}"
            )
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        os.unlink(res)
    return _json_object(data, "unreadable answer from the plugin")
