"""HTTP/1.1 requests and answers of `driver.observability.bounded_http`: the types its
handlers see, reading a request head and writing an answer (pure functions, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final

MAX_REQUEST_HEAD: Final = 8192
MAX_CONTENT_LENGTH_DIGITS: Final = 15
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


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    headers: Mapping[str, str]  # lower-case names
    size: int  # bytes, the blank line included

    @property
    def keep_alive(self) -> bool:
        """Whether the client lets the connection carry another request."""
        return self.version == "HTTP/1.1" and self.headers.get("connection", "").lower() != "close"


class BadRequest(ValueError):
    """Not an HTTP request: the connection is closed without an answer."""


def parse_head(buf: bytes | bytearray) -> RequestHead | None:
    """The request head at the start of `buf`; None while it is incomplete. Raises
    `BadRequest` for a malformed head or one longer than `MAX_REQUEST_HEAD`."""
    end, separator = buf.find(b"\r\n\r\n"), 4
    if end < 0:
        end, separator = buf.find(b"\n\n"), 2
    if end < 0:
        if len(buf) > MAX_REQUEST_HEAD:
            raise BadRequest("request head too long")
        return None
    if end > MAX_REQUEST_HEAD:
        raise BadRequest("request head too long")
    # Lines end at LF only (CR LF included): `str.splitlines` would also break at
    # latin-1 NEL and the other separators a header value may carry.
    lines = [line.removesuffix(b"\r").decode("latin-1") for line in bytes(buf[:end]).split(b"\n")]
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise BadRequest("malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            name, value = name.strip().lower(), value.strip()
            # A repeated header is one list (RFC 9110 5.3): two Content-Lengths are
            # then not a number, and refused.
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return RequestHead(parts[0], parts[1], parts[2], headers, end + separator)


def body_length(head: RequestHead, max_body: int) -> int | Response:
    """The length of the body that follows `head`, or the answer that refuses it."""
    declared = head.headers.get("content-length")
    if "transfer-encoding" in head.headers or (declared is None and head.method in BODY_METHODS):
        return Response(HTTPStatus.LENGTH_REQUIRED, b"Content-Length required")
    if declared is None:
        return 0
    # ASCII digits only: str.isdigit() also accepts the '²' that latin-1 makes of 0xB2,
    # which int() refuses.
    if not (declared.isascii() and declared.isdigit()):
        return Response(HTTPStatus.BAD_REQUEST, b"bad Content-Length")
    if len(declared) > MAX_CONTENT_LENGTH_DIGITS or int(declared) > max_body:
        return Response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"request body too large")
    return int(declared)


def take_request(buf: bytearray, max_body: int) -> tuple[Request, bool] | Response | None:
    """Removes the first complete request from `buf` and returns it with whether the
    client keeps the connection open after it; None while it is incomplete; the answer
    that refuses it (the connection then closes). Bodies longer than `max_body` are
    refused; with 0, none is read. Raises `BadRequest`."""
    head = parse_head(buf)
    if head is None:
        return None
    length = 0
    if max_body:
        length_or_refusal = body_length(head, max_body)
        if isinstance(length_or_refusal, Response):
            return length_or_refusal
        length = length_or_refusal
        if len(buf) < head.size + length:
            return None  # more body to come
    body = bytes(buf[head.size : head.size + length])
    del buf[: head.size + length]
    return Request(head.method, head.target, head.headers, body), head.keep_alive


def render(response: Response, *, close: bool, head_only: bool = False) -> bytes:
    """The bytes of an HTTP/1.1 answer."""
    status = response.status
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
    ]
    if close:
        lines.append("Connection: close")
    if response.allow:
        lines.append(f"Allow: {response.allow}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body
