"""The webhook on hypercorn (asyncio worker, HTTP/1.1 by h11 only: ALPN offers
`http/1.1`), as configured below and nothing else.

Bounds hypercorn offers, and their values here:
- `keep_alive_timeout=10`: from the connection's start (after its TLS handshake) until
  a complete request head, and again after each answer; so it is also a deadline for
  the head of each request, however its bytes arrive. It stops while a body is read.
- `read_timeout=10`: a connection is closed when a read waits longer; an idle timeout,
  not a deadline: a byte every few seconds keeps a body (or head) going.
- `h11_max_incomplete_size=8192`: a request head larger than 8 KiB is refused (400)
  and the connection closed.
- `ssl_handshake_timeout=10`: the TLS handshake (asyncio's option, which hypercorn sets).
- `backlog=128`: the listen queue; `max_app_queue_size` (10, its default): body chunks
  queued for the application before reading pauses.
- the body: nothing for ASGI (`wsgi_max_body_size` is for WSGI applications only); the
  application refuses a `Content-Length` above 3 MiB (413) and counts what it reads.

Bounds it lacks: no header count limit (the head size only), no connection cap or
concurrency limit, no per-address limit, no overall deadline for a body.

The listening socket is handed over as `fd://N`; `port N` is printed once it listens
(the kernel queues connections until hypercorn accepts them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config

from bench.http_candidates import common


def main() -> None:
    args = common.arguments()
    sock = common.listen()
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.certfile = args.tls_cert_file
    config.keyfile = args.tls_private_key_file
    config.alpn_protocols = ["http/1.1"]
    config.keep_alive_timeout = common.TIMEOUT
    config.read_timeout = common.TIMEOUT
    config.ssl_handshake_timeout = common.TIMEOUT
    config.h11_max_incomplete_size = common.MAX_HEAD
    config.backlog = common.BACKLOG
    config.accesslog = None
    config.loglevel = "WARNING"
    common.announce(sock)
    app: Any = common.asgi_app  # hypercorn's ASGI types are TypedDicts, ours plain dicts
    asyncio.run(serve(app, config))


if __name__ == "__main__":
    main()
