"""Listening sockets for `driver.observability.bounded_http`: a TCP port, or a Unix
socket that only its owner may open (the plugin's status socket).

A Unix socket's mode cannot be set on an open socket, and `umask` is the whole
process's: the socket is bound under a temporary name beside the final one, given its
mode, and then renamed over the final name. A client never finds it with the wrong
mode, and a stale socket a crashed process left (or a second instance's, during a
rolling update) is replaced in one step. `remove_unix` later removes it only while it
is still the one this process bound.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

BACKLOG: Final = 128
SUN_PATH_MAX: Final = 107  # AF_UNIX sun_path holds 108 bytes including the terminating NUL


def listen_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` (IPv4 or IPv6; "" for every IPv4 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


@dataclass(frozen=True)
class UnixListener:
    sock: socket.socket
    path: Path
    inode: tuple[int, int]  # (st_dev, st_ino) of the socket file this process bound


def listen_unix(path: Path, mode: int = 0o600) -> UnixListener:
    """A listening Unix socket at `path` with `mode`, replacing whatever socket was
    there. Raises ValueError (a path too long, or not a socket in the way) or OSError."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    if len(os.fsencode(temp)) > SUN_PATH_MAX:
        limit = SUN_PATH_MAX - (len(temp.name) - len(path.name))
        raise ValueError(f"socket path {path} is longer than {limit} bytes (the Unix socket limit)")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValueError(f"{path} exists and is not a socket: move it aside")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(temp))
        try:
            os.chmod(temp, mode)
            sock.listen(BACKLOG)
            bound = temp.lstat()
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    except BaseException:
        sock.close()
        raise
    return UnixListener(sock, path, (bound.st_dev, bound.st_ino))


def still_bound(listener: UnixListener) -> bool:
    """Whether the socket file at the listener's path is still the one it bound."""
    try:
        found = listener.path.lstat()
    except FileNotFoundError:
        return False
    return (found.st_dev, found.st_ino) == listener.inode


def remove_unix(listener: UnixListener) -> None:
    """Removes the socket file if it is still the one `listener` bound: a newer
    instance's socket at the same path stays."""
    if still_bound(listener):
        listener.path.unlink(missing_ok=True)
