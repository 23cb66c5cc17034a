"""The worker threads of `driver.observability.bounded_http`: a lane of threads that
answer queued requests, the smallest first, from a queue of bounded length."""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Generic, TypeVar

from driver.observability.http_messages import Request, Response

log = logging.getLogger(__name__)

Handler = Callable[[Request], Response]
Client = TypeVar("Client")


@dataclass(frozen=True)
class Job(Generic[Client]):
    client: Client  # whom the answer goes to
    request: Request


class WorkerLane(Generic[Client]):
    """`count` threads answering the queued jobs with `handler`, the smallest request
    first; `finished` gets each answer. At most `max_queued` jobs wait: `put` says which
    one does not fit. Jobs whose client `gone` says has left (closed while it waited)
    are dropped unanswered."""

    def __init__(
        self,
        name: str,
        count: int,
        handler: Handler,
        finished: Callable[[Job[Client], Response], None],
        gone: Callable[[Client], bool],
        max_queued: int,
    ) -> None:
        self._handler = handler
        self._finished = finished
        self._gone = gone
        self._max_queued = max_queued
        self._waiting: list[tuple[int, int, Job[Client]]] = []  # a heap, smallest first
        self._changed = threading.Condition()
        self._stopping = False
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]

    def start(self) -> None:
        for thread in self._threads:
            if not thread.is_alive():
                thread.start()

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet taken by a worker."""
        return len(self._waiting)

    def put(self, job: Job[Client]) -> Job[Client] | None:
        """Queues `job`; returns the job left out when `max_queued` already wait: the
        largest (of those, the newest) of the waiting ones and `job`."""
        entry = (len(job.request.body), next(self._order), job)
        with self._changed:
            left_out = None
            if len(self._waiting) >= self._max_queued:
                largest = max(self._waiting, key=_size_then_order)
                if _size_then_order(entry) > _size_then_order(largest):
                    return job
                self._waiting.remove(largest)
                heapq.heapify(self._waiting)
                left_out = largest[2]
            heapq.heappush(self._waiting, entry)
            self._changed.notify()
        return left_out

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                _, _, job = heapq.heappop(self._waiting)
            if self._gone(job.client):
                continue
            self._finished(job, respond(functools.partial(self._handler, job.request)))


def respond(handler: Callable[[], Response]) -> Response:
    """`handler()`, or 500 where it raises."""
    try:
        return handler()
    except Exception:
        log.exception("HTTP handler error")
        return Response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n")


def _size_then_order(entry: tuple[int, int, object]) -> tuple[int, int]:
    return entry[0], entry[1]
