"""Logging of the three binaries: one verbosity scale (`-v N`, env `V`; the table is in
docs/operations.md, "Log reference"), text or JSON lines (each carrying the current
request id), and quiet retries (`RetryLog`).

The daemons default to 2 (as the chart's `logVerbosity`), the CLI to 0 (its stdout is
the command's output). urllib3, the API client's HTTP library, logs only from `-v 5`,
and never a header or a body.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

DAEMON_VERBOSITY: Final = 2
DEBUG_VERBOSITY: Final = 4
CLIENT_DEBUG_VERBOSITY: Final = 5
VERBOSITY_HELP: Final = (
    "log verbosity: 0 warnings and errors, 1-3 also info, 4 also debug, 5 also the "
    "HTTP client's lines"
)
HTTP_CLIENT_LOGGER: Final = "urllib3"
RETRY_LOG_INTERVAL: Final = 60.0
# A message longer than this is cut (a forged review once made a 3 MB log line).
MAX_LOGGED_CHARS: Final = 16384

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def apply_verbosity(verbosity: int) -> None:
    """Set the root logger's level and the client libraries' for `verbosity`. The HTTP
    client (urllib3) logs every retry of a request at WARNING: during an API outage
    that is several lines a second, so below 5 only its errors pass (the callers log
    the outage themselves, `RetryLog`)."""
    own = logging.INFO if verbosity >= 1 else logging.WARNING
    logging.getLogger().setLevel(logging.DEBUG if verbosity >= DEBUG_VERBOSITY else own)
    client = logging.DEBUG if verbosity >= CLIENT_DEBUG_VERBOSITY else logging.ERROR
    logging.getLogger(HTTP_CLIENT_LOGGER).setLevel(client)


@contextmanager
def request_scope(prefix: str) -> Iterator[str]:
    """Tags every log record emitted inside the block with a fresh request id."""
    rid = f"{prefix}-{uuid.uuid4().hex[:12]}"
    token = request_id.set(rid)
    try:
        yield rid
    finally:
        request_id.reset(token)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def escaped(text: str, limit: int | None = None) -> str:
    """`text` with each non-printable character (line breaks, tabs, terminal escape
    sequences, bidirectional controls) written as its Python escape (`\\n`, `\\x1b`,
    `\\u202e`), cut after `limit` characters: a string a tenant or a client chose can
    then neither forge a log line nor drive the terminal it is printed on."""
    cut = max(0, len(text) - limit) if limit is not None else 0
    shown = text[: len(text) - cut]
    if not shown.isprintable():
        shown = "".join(
            c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in shown
        )
    return f"{shown}... ({cut} more characters)" if cut else shown


class EscapingFormatter(logging.Formatter):
    """A text formatter whose messages are `escaped` and cut at `MAX_LOGGED_CHARS` (an
    exception's traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escaped(record.message, MAX_LOGGED_CHARS)
        return super().formatMessage(record)


def stderr_handler(fmt: str) -> logging.Handler:
    """A stderr handler formatting with `fmt`, messages escaped."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter(fmt))
    return handler


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": escaped(record.getMessage(), MAX_LOGGED_CHARS),
            "requestID": getattr(record, "request_id", "-"),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def setup_logging(fmt: str, verbosity: int) -> None:
    """The daemons' logging: text or JSON lines on stderr at `verbosity`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else EscapingFormatter(TEXT_FORMAT))
    logging.getLogger().handlers[:] = [handler]
    apply_verbosity(verbosity)


class RetryLog:
    """Logs an operation that is retried until it succeeds: its first failure (and a
    failure of another kind) at `level`, then one line per `RETRY_LOG_INTERVAL` while
    it keeps failing, every attempt at DEBUG, and the recovery at INFO. Thread-safe:
    the loops of one component can share it."""

    def __init__(
        self, logger: logging.Logger, what: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._since = 0.0
        self._logged_at = 0.0
        self._kind = ""

    def failed(self, err: BaseException, retry_in: float, *, level: int = logging.WARNING) -> None:
        now = self._clock()
        kind = type(err).__name__
        with self._lock:
            first = self._failures == 0
            self._failures += 1
            if first:
                self._since = now
            if first or kind != self._kind:
                message = "%s failed, retrying in %.1fs (while it lasts, logged every %.0fs): %s"
                args: tuple[object, ...] = (self._what, retry_in, RETRY_LOG_INTERVAL, err)
            elif now - self._logged_at >= RETRY_LOG_INTERVAL:
                message = "%s still failing: %d attempts in %.0fs; last: %s"
                args = (self._what, self._failures, now - self._since, err)
            else:
                self._log.debug("%s failed, retrying in %.1fs: %s", self._what, retry_in, err)
                return
            self._kind = kind
            self._logged_at = now
        self._log.log(level, message, *args)

    def succeeded(self) -> None:
        with self._lock:
            failures, since = self._failures, self._since
            self._failures = 0
            self._kind = ""
        if failures:
            self._log.info(
                "%s works again after %d failed attempt(s) in %.0fs",
                self._what,
                failures,
                self._clock() - since,
            )
