"""The requests and answers the handlers of `driver.observability.bounded_http` see,
and the one rule on request bodies the HTTP library leaves to its user (pure
functions, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final

BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass(frozen=True)
class Response:
    status: HTTPStatus
    body: bytes = b""
    content_type: str = "text/plain"
    allow: str | None = None


def body_length(method: str, headers: Mapping[str, str], max_body: int) -> int | Response:
    """The length of the body a request head announces (the parser has checked that
    Content-Length is one number), or the answer that refuses it: a chunked body
    (411: its length is not known before it is read) or one over `max_body` (413)."""
    declared = headers.get("content-length")
    if "transfer-encoding" in headers or (declared is None and method in BODY_METHODS):
        return Response(HTTPStatus.LENGTH_REQUIRED, b"Content-Length required")
    length = int(declared) if declared is not None else 0
    if length > max_body:
        return Response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"request body too large")
    return length
