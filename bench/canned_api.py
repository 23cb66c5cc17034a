"""A stand-in API server that answers every GET with one ResourceClaim, for profiling
the plugin's claim read without a control plane (`bench.profile_call`)."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.queues
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

DRIVER = "gpu.example.com"


def canned_claim(namespace: str, name: str, uid: str, node: str) -> dict[str, Any]:
    """The bench's allocated claim (bench.scenarios.allocated_claim) as the API server
    returns it, managedFields included: they are most of its bytes."""
    when = "2026-11-26T00:00:00Z"
    request = {"name": "gpu", "exactly": {"deviceClassName": f"bench-{DRIVER}"}}
    result = {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}
    selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}

    def managed(fields: dict[str, Any], **extra: str) -> dict[str, Any]:
        return {
            "manager": "python-urllib3",
            "operation": "Update",
            "apiVersion": "resource.k8s.io/v1",
            "time": when,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
            **extra,
        }

    allocation_fields: dict[str, Any] = {
        ".": {},
        "f:devices": {".": {}, "f:results": {}},
        "f:nodeSelector": {},
    }
    return {
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": "4242",
            "creationTimestamp": when,
            "managedFields": [
                managed({"f:spec": {"f:devices": {".": {}, "f:requests": {}}}}),
                managed({"f:status": {"f:allocation": allocation_fields}}, subresource="status"),
            ],
        },
        "spec": {"devices": {"requests": [request]}},
        "status": {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {"nodeSelectorTerms": [selector]},
            }
        },
    }


def start_canned_api(claim: dict[str, Any], work: Path) -> Path:
    """Serve `claim` from a child process; returns a kubeconfig (plain http, no
    credentials) that points at it."""
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.queues.Queue[int] = ctx.Queue()
    body = json.dumps(claim).encode()
    ctx.Process(target=_serve, args=(body, ports), daemon=True).start()
    server = f"http://127.0.0.1:{ports.get(timeout=30)}"
    kubeconfig = work / "canned.kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "current-context": "canned",
                "contexts": [{"name": "canned", "context": {"cluster": "canned"}}],
                "clusters": [{"name": "canned", "cluster": {"server": server}}],
            }
        )
    )
    return kubeconfig


def _serve(body: bytes, port_out: multiprocessing.queues.Queue[int]) -> None:
    """A keep-alive HTTP server answering every GET with `body`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            # One write: headers and body in separate segments meet the client's
            # delayed ACK (40 ms per GET).
            head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            self.wfile.write(head.encode() + body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(server.server_address[1])
    server.serve_forever()
