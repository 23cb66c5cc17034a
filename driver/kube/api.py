"""Raw JSON access to the API server.

The typed models of the official client drop fields they do not know on read and are
strict about types, so a read-modify-write through them can erase what a newer server
added. Everything here sends dict bodies and returns parsed JSON over a urllib3 pool
(driver/kube/connection.py: kubeconfig / in-cluster settings, TLS, authentication).

Every body is parsed with `driver.config.loads_json`, the decoder the webhook uses:
it keeps duplicate keys detectable, so a ResourceClaim whose opaque parameters repeat
a key (the API server stores them verbatim) fails at prepare exactly as it fails
admission. `strict=False` parses with `json.loads` (about five times faster) for
objects without free-form fields, which the API server always writes out with
distinct keys (ResourceSlices). Names that go into a URL are quoted with `segment()`.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

import urllib3

from driver.config.loader import loads_json
from driver.kube.connection import Connection, connect

JSON = dict[str, Any]

APPLY_PATCH = "application/apply-patch+yaml"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(f"{status} {reason}: {_status_message(body)}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def segment(value: str) -> str:
    """`value` as one URL path segment: every reserved character quoted (`/` included),
    so a name can never add, remove or leave a path segment. Raises ValueError for
    `""`, `.` and `..`, which quoting leaves as they are."""
    if value in ("", ".", ".."):
        raise ValueError(f"{value!r} cannot be a URL path segment")
    return urllib.parse.quote(value, safe="")


def _decode(data: bytes, strict: bool) -> Any:
    return loads_json(data) if strict else json.loads(data)


def _status_message(body: str) -> str:
    try:
        return str(loads_json(body).get("message", body))
    except (ValueError, AttributeError):
        return body[:500]


class KubeApi:
    """A thin JSON client. Thread-safe: urllib3's pool is shared between threads."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self.writes = 0  # POST/PUT/PATCH/DELETE sent; benchmarks read it

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None) -> KubeApi:
        """From a kubeconfig file, or the in-cluster settings if None."""
        return cls(connect(kubeconfig))

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str | int] | None = None,
        body: object = None,
        content_type: str | None = None,
        timeout: float = 30.0,
        strict: bool = True,
    ) -> JSON:
        response = self._send(method, path, query, body, content_type, timeout, stream=False)
        data = response.data
        if not 200 <= response.status <= 299:
            raise ApiError(response.status, response.reason or "", data.decode(errors="replace"))
        parsed: JSON = _decode(data, strict) if data else {}
        return parsed

    def get_text(self, path: str, *, timeout: float = 30.0) -> str:
        """A GET of an endpoint that does not answer JSON (e.g. `/metrics`)."""
        response = self._connection.request(
            "GET", path, headers={"Accept": "text/plain"}, body=None, timeout=timeout, stream=False
        )
        text = response.data.decode(errors="replace")
        if not 200 <= response.status <= 299:
            raise ApiError(response.status, response.reason or "", text)
        return text

    def watch(
        self,
        path: str,
        *,
        query: Mapping[str, str | int],
        timeout_seconds: int = 300,
        strict: bool = True,
    ) -> Iterator[tuple[str, JSON]]:
        """Yields (type, object) watch events until the server closes the stream."""
        params = {**query, "watch": "true", "timeoutSeconds": timeout_seconds}
        raw = self._send("GET", path, params, None, None, timeout_seconds + 10, stream=True)
        try:
            if not 200 <= raw.status <= 299:
                body = raw.read().decode(errors="replace")
                raise ApiError(raw.status, raw.reason or "", body)
            buffer = b""
            for chunk in raw.stream(64 * 1024, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event = _decode(line, strict)
                        yield event["type"], event["object"]
        finally:
            raw.release_conn()

    def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, str | int] | None,
        body: object,
        content_type: str | None,
        timeout: float,
        *,
        stream: bool,
    ) -> urllib3.BaseHTTPResponse:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            data = json.dumps(body).encode()  # JSON is valid YAML: apply patches too
        if query:
            path = f"{path}?{urllib.parse.urlencode(list(query.items()))}"
        if method != "GET":
            with self._lock:
                self.writes += 1
        return self._connection.request(
            method, path, headers=headers, body=data, timeout=timeout, stream=stream
        )
