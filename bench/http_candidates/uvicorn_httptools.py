"""The webhook on uvicorn with its httptools (llhttp) protocol, as configured below and
nothing else; `uvicorn_h11` runs the same with h11.

Bounds uvicorn offers, and their values here:
- `limit_concurrency=64`: once 64 connections are open (or 64 requests in progress), a
  request is answered 503 ("Exceeded concurrency limit."); a connection is not refused
  or closed for it, and connections still in their TLS handshake are not counted.
- `timeout_keep_alive=10`: an idle keep-alive connection is closed 10 s after its last
  answer. It runs between requests only, not before the first one.
- `backlog=128`: the listen queue.
- `h11_max_incomplete_event_size=8192` (h11 only): a request head larger than 8 KiB is
  refused with 400 and the connection closed. httptools ignores it.
- the body: nothing in uvicorn; the application refuses a `Content-Length` above 3 MiB
  (413) and counts what it reads (`common.asgi_app`). Reading pauses above 64 KiB
  buffered (uvicorn's flow control).

Bounds it lacks:
- no deadline, nor idle timeout, for a request's head or body: a connection that never
  completes its first request is held for as long as its client keeps it open;
- no head size or header count limit with httptools (h11: head size only, no count);
- no TLS handshake timeout of its own: asyncio's default (60 s) applies;
- no per-address limit; no cap that closes connections (only the 503 above).
"""

from __future__ import annotations

import asyncio

import uvicorn

from bench.http_candidates import common


def serve(http: str) -> None:
    args = common.arguments()
    context = common.tls_context(args)
    config = uvicorn.Config(
        common.asgi_app,
        http=http,
        lifespan="on",
        access_log=False,
        log_level="warning",
        limit_concurrency=common.MAX_CONNECTIONS,
        timeout_keep_alive=common.TIMEOUT,
        backlog=common.BACKLOG,
        h11_max_incomplete_event_size=common.MAX_HEAD,
        ssl_context_factory=lambda _config, _default: context,
    )
    server = uvicorn.Server(config)
    sock = common.listen()

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        common.announce(sock)
        await task

    asyncio.run(main())


if __name__ == "__main__":
    serve("httptools")
