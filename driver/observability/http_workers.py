"""The worker threads of `driver.observability.bounded_http`: handlers run there, off
the event loop, the smallest waiting request first."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from driver.observability.http_messages import Request, Response

log = logging.getLogger(__name__)

Handler = Callable[[Request], Response]  # runs in a worker thread


class WorkerLane:
    """`workers` threads running handlers; at most `max_queued` requests wait for one,
    the smallest first. Where the queue is full, the largest of the waiting ones and
    the new one (of equals, the newest) is left out: a small review is never turned
    away because large ones fill the queue."""

    def __init__(self, name: str, workers: int, max_queued: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._free = workers
        self._max_queued = max_queued
        self._waiting: list[tuple[int, int, asyncio.Future[bool]]] = []  # a heap
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def run(self, handler: Handler, request: Request) -> tuple[Response, bool] | None:
        """(the answer, whether the handler raised); None where it was left out."""
        loop = asyncio.get_running_loop()
        if self._free:
            self._free -= 1
        else:
            entry = (len(request.body), next(self._order), loop.create_future())
            if len(self._waiting) >= self._max_queued:
                largest = max(self._waiting)
                if entry[:2] > largest[:2]:
                    return None
                self._waiting.remove(largest)
                heapq.heapify(self._waiting)
                largest[2].set_result(False)
            heapq.heappush(self._waiting, entry)
            if not await entry[2]:
                return None
        try:
            return await loop.run_in_executor(self._pool, run_safely, lambda: handler(request))
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        """Gives the worker just freed to the smallest waiting request."""
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # not cancelled meanwhile
                turn.set_result(True)
                return
        self._free += 1

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def run_safely(handler: Callable[[], Response]) -> tuple[Response, bool]:
    """(`handler()`, False), or (500, True) where it raises."""
    try:
        return handler(), False
    except Exception:
        log.exception("HTTP handler error")
        return Response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n"), True
