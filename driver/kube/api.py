"""Raw JSON access to the API server.

The typed models of the official client drop fields they do not know on read and are
strict about types, so a read-modify-write through them can erase what a newer server
added. Everything here sends dict bodies and returns parsed JSON; the client library
still does what it is good at: kubeconfig / in-cluster loading, TLS and authentication.

Every body is parsed with `driver.config.loads_json`, the decoder the webhook uses:
it keeps duplicate keys detectable, so a ResourceClaim whose opaque parameters repeat
a key (the API server stores them verbatim) fails at prepare exactly as it fails
admission. Names that go into a URL are quoted with `segment()`.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

from kubernetes import client, config

from driver.config.loader import loads_json

log = logging.getLogger(__name__)

JSON = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
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

    @property
    def gone(self) -> bool:
        return self.status == 410


def segment(value: str) -> str:
    """`value` as one URL path segment: every reserved character quoted (`/` included),
    so a name can never add, remove or leave a path segment. Raises ValueError for
    `""`, `.` and `..`, which quoting leaves as they are."""
    if value in ("", ".", ".."):
        raise ValueError(f"{value!r} cannot be a URL path segment")
    return urllib.parse.quote(value, safe="")


def _status_message(body: str) -> str:
    try:
        return str(loads_json(body).get("message", body))
    except (ValueError, AttributeError):
        return body[:500]


class KubeApi:
    """A thin JSON client. Thread-safe: urllib3's pool is shared between threads."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._client = api_client
        self._lock = threading.Lock()
        self.writes = 0  # POST/PUT/PATCH/DELETE sent; benchmarks read it

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None) -> KubeApi:
        configuration = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str | int] | None = None,
        body: object = None,
        content_type: str | None = None,
        timeout: float = 30.0,
    ) -> JSON:
        response = self._send(method, path, query, body, content_type, timeout, stream=False)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiError(response.status, response.reason or "", data.decode(errors="replace"))
        parsed: JSON = loads_json(data) if data else {}
        return parsed

    def watch(
        self, path: str, *, query: Mapping[str, str | int], timeout_seconds: int = 300
    ) -> Iterator[tuple[str, JSON]]:
        """Yields (type, object) watch events until the server closes the stream."""
        params = {**query, "watch": "true", "timeoutSeconds": timeout_seconds}
        response = self._send("GET", path, params, None, None, timeout_seconds + 10, stream=True)
        raw = response.response
        try:
            if not 200 <= response.status <= 299:
                body = raw.read().decode(errors="replace")
                raise ApiError(response.status, response.reason or "", body)
            buffer = b""
            for chunk in raw.stream(64 * 1024, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event = loads_json(line)
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
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        method_, url, header_params, serialized, _ = self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        if method != "GET":
            with self._lock:
                self.writes += 1
        if stream:
            return self._client.rest_client.request(
                method_, url, headers=header_params, body=None, _request_timeout=timeout
            )
        return self._client.call_api(
            method_, url, header_params=header_params, body=serialized, _request_timeout=timeout
        )
