"""The prepare and unprepare calls in flight, so that the plugin's clean stop can wait
for them (bounded) before it compacts the journal (driver/state/recovery/startup_recovery.py,
`compact_journal`; docs/state.md, "The log"). gRPC's `server.stop(grace)` stops
accepting calls and cancels the ones still running after `grace`, but their handler
threads go on; they are counted here."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class InFlight:
    """How many prepare/unprepare calls are running; `drain` waits for none."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._running = 0

    @property
    def running(self) -> int:
        with self._idle:
            return self._running

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Counts the block as a call in flight."""
        with self._idle:
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                if not self._running:
                    self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no call is in flight, at most `timeout` seconds; False if some
        still are."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True
