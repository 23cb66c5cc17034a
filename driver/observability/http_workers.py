"""The worker threads of `driver.observability.bounded_http`: a lane of threads that
answer queued requests, the smallest first."""

from __future__ import annotations

import itertools
import logging
import queue
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
    first; `finished` gets each answer. Jobs whose client `gone` says has left (closed
    while it waited) are dropped unanswered."""

    def __init__(
        self,
        name: str,
        count: int,
        handler: Handler,
        finished: Callable[[Job[Client], Response], None],
        gone: Callable[[Client], bool],
    ) -> None:
        self._handler = handler
        self._finished = finished
        self._gone = gone
        self._queue: queue.PriorityQueue[tuple[int, int, Job[Client] | None]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]

    def start(self) -> None:
        for thread in self._threads:
            if not thread.is_alive():
                thread.start()

    def put(self, job: Job[Client]) -> None:
        self._queue.put((len(job.request.body), next(self._order), job))

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put((-1, next(self._order), None))

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            if self._gone(job.client):
                continue
            try:
                response = self._handler(job.request)
            except Exception:
                log.exception("HTTP handler error")
                response = Response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n")
            self._finished(job, response)
