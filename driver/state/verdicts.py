"""Permanent verdicts (KEP-5322): which error classes are permanent, and the bounded,
expiring memory that answers a retried claim at once (no API read, no NVML, no disk)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from driver.errors import DriverError, ErrorClass

DEFAULT_PERMANENT_ERRORS: Final = frozenset({ErrorClass.INVALID_CONFIG, ErrorClass.DEVICE_FAILED})
DEFAULT_VERDICT_TTL: Final = 300.0
DEFAULT_VERDICT_LIMIT: Final = 4096


def parse_permanent_errors(value: str) -> frozenset[ErrorClass]:
    """`--permanent-errors invalid-config,device-failed` -> the set of classes; ''
    means none. Raises ValueError naming an unknown or transient class."""
    classes: set[ErrorClass] = set()
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            cls = ErrorClass(part)
        except ValueError:
            raise ValueError(
                f"unknown error class {part!r} (known: invalid-config, device-failed)"
            ) from None
        if cls is ErrorClass.TRANSIENT:
            raise ValueError("transient is not a permanent error class")
        classes.add(cls)
    return frozenset(classes)


@dataclass
class _Verdict:
    error: DriverError
    expires: float


class VerdictMemory:
    """Permanent verdicts by claim UID: at most `limit`, each for `ttl` seconds."""

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_VERDICT_TTL,
        limit: int = DEFAULT_VERDICT_LIMIT,
        clock: Callable[[], float],
    ) -> None:
        self._ttl = ttl
        self._limit = limit
        self._clock = clock
        self._verdicts: OrderedDict[str, _Verdict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, uid: str) -> DriverError | None:
        with self._lock:
            verdict = self._verdicts.get(uid)
            if verdict is None:
                return None
            if self._clock() >= verdict.expires:
                del self._verdicts[uid]
                return None
            return verdict.error

    def remember(self, uid: str, err: DriverError) -> None:
        with self._lock:
            self._verdicts[uid] = _Verdict(err, self._clock() + self._ttl)
            self._verdicts.move_to_end(uid)
            while len(self._verdicts) > self._limit:
                self._verdicts.popitem(last=False)

    def forget(self, uids: Iterable[str]) -> None:
        with self._lock:
            for uid in uids:
                self._verdicts.pop(uid, None)
