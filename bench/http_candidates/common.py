"""What every candidate server shares: the webhook endpoint as `driver/webhook/server.py`
serves it, the values of the bounds (the real server's, where the library has the
bound), its TLS context and a listening socket on 127.0.0.1 port 0.

The review runs in a pool of `WORKERS` threads (the real server's two workers); the
health paths are answered on the event loop. The ASGI application serves uvicorn and
hypercorn; aiohttp calls `answer` from its own handler.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from driver.config import LoadError, loads_json
from driver.webhook.admission import BadReview, review

DRIVER: Final = "gpu.example.com"
VALIDATE_PATH: Final = "/validate-resource-claim-parameters"
HEALTH_PATHS: Final = frozenset({"/readyz", "/healthz", "/livez"})
MAX_BODY: Final = 3 * 1024 * 1024  # the API server's two 1.5 MiB objects
MAX_HEAD: Final = 8 * 1024  # the real server's request head
MAX_LINE: Final = 8190  # aiohttp's default for the request line and one header line
MAX_HEADERS: Final = 32
MAX_CONNECTIONS: Final = 64  # the real server's connection table
TIMEOUT: Final = 10  # seconds: the API server's review deadline (timeoutSeconds)
BACKLOG: Final = 128  # the real server's listen backlog
WORKERS: Final = 2

EXECUTOR = ThreadPoolExecutor(WORKERS, thread_name_prefix="review")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tls-cert-file", required=True)
    parser.add_argument("--tls-private-key-file", required=True)
    return parser.parse_args()


def tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    """As `driver.webhook.server.TLSFiles` makes it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(args.tls_cert_file, args.tls_private_key_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


def listen() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0), backlog=BACKLOG)


def announce(sock: socket.socket) -> None:
    print("port", sock.getsockname()[1], flush=True)


def _validate(body: bytes) -> tuple[int, str, bytes]:
    try:
        answer = review(loads_json(body), DRIVER)
    except (LoadError, BadReview) as err:
        message = f"failed to read AdmissionReview from request body: {err}"
        return 400, "text/plain", message.encode()
    return 200, "application/json", json.dumps(answer).encode()


def check_post(path: str, content_type: str) -> tuple[int, str, bytes] | None:
    """The answer to a POST refused before its body is read; None to read it."""
    if path != VALIDATE_PATH:
        return 404, "text/plain", b"not found"
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        message = f"contentType={content_type}, expected application/json"
        return 415, "text/plain", message.encode()
    return None


async def answer(body: bytes) -> tuple[int, str, bytes]:
    """A review's answer, computed by a worker thread."""
    return await asyncio.get_running_loop().run_in_executor(EXECUTOR, _validate, body)


async def _respond(send: Send, status: int, content_type: str, body: bytes) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def asgi_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    if scope["type"] != "http":
        return None
    method, path = scope["method"], scope["path"]
    if method in ("GET", "HEAD"):
        ok = path in HEALTH_PATHS
        return await _respond(send, 200 if ok else 404, "text/plain", b"ok" if ok else b"")
    if method != "POST":
        return await _respond(send, 405, "text/plain", b"method not allowed")
    headers = {name.lower(): value for name, value in scope["headers"]}
    refused = check_post(path, headers.get(b"content-type", b"").decode("latin-1"))
    if refused:
        return await _respond(send, *refused)
    declared = headers.get(b"content-length", b"0")
    if not declared.isdigit() or int(declared) > MAX_BODY:
        return await _respond(send, 413, "text/plain", b"request body too large")
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None  # the client went away
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY:
            return await _respond(send, 413, "text/plain", b"request body too large")
        more = message.get("more_body", False)
    return await _respond(send, *await answer(b"".join(chunks)))
