"""The webhook on aiohttp's server (`web.Application`, its `AppRunner`'s low-level
`Server` handed to asyncio's `create_server`), as configured below and nothing else:
the reference candidate (aiohttp is in .venv already, for the Kubernetes client).

Bounds aiohttp offers, and their values here:
- `client_max_size=3 MiB`: `request.read()` refuses a larger body (413).
- `max_line_size=8190`, `max_field_size=8190`: the request line and each header line
  (400 beyond); `max_headers=32`: the header count (its default is 128).
- `keepalive_timeout=10`: armed when the connection is made and after each answer, and
  not pushed back by arriving bytes; it closes a connection whose handler is waiting for
  a complete head, so in 3.14 it is also a deadline for the first request's head.
- asyncio's `create_server`: `ssl_handshake_timeout=10`, `backlog=128` (aiohttp's own
  `SockSite` would leave the handshake at asyncio's default, 60 s).

Bounds it lacks: no deadline nor idle timeout while a body is read (a byte every few
seconds holds the connection), no head size limit as a whole (32 lines of 8190 bytes),
no connection cap or concurrency limit, no per-address limit.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from bench.http_candidates import common


async def _health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _validate(request: web.Request) -> web.Response:
    refused = common.check_post(request.path, request.headers.get("Content-Type", ""))
    if refused:
        status, content_type, body = refused
    else:
        status, content_type, body = await common.answer(await request.read())
    return web.Response(status=status, body=body, content_type=content_type)


async def _serve() -> None:
    args = common.arguments()
    app = web.Application(client_max_size=common.MAX_BODY)
    for path in sorted(common.HEALTH_PATHS):
        app.router.add_get(path, _health)
    app.router.add_post(common.VALIDATE_PATH, _validate)
    runner = web.AppRunner(
        app,
        access_log=None,
        keepalive_timeout=common.TIMEOUT,
        max_line_size=common.MAX_LINE,
        max_field_size=common.MAX_LINE,
        max_headers=common.MAX_HEADERS,
    )
    await runner.setup()
    assert runner.server is not None
    sock = common.listen()
    server = await asyncio.get_running_loop().create_server(
        runner.server,
        sock=sock,
        ssl=common.tls_context(args),
        backlog=common.BACKLOG,
        ssl_handshake_timeout=common.TIMEOUT,
    )
    common.announce(sock)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve())
