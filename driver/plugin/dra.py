"""The kubelet's DRA service (v1 and v1beta1): protobuf in, DeviceState, protobuf out.

Transport only. Per-claim failures travel in the response map with `error_type` set
for permanent ones (KEP-5322); a gRPC error is reserved for a request that cannot be
answered at all.

Claim references are validated here, before anything uses them (INVALID_ARGUMENT
naming the field, e.g. `claims[3].uid: "common" is not a UID`): the UID becomes a
file name (`<cdi root>/k8s.<driver>-gpu_<uid>.json`, so the UID `common` would be
the node-wide spec) and the namespace and name become API URL path segments.

- uid: the canonical 8-4-4-4-12 lowercase hex form of a UUID. `types.UID` in
  k8s.io/apimachinery is any string, but every ResourceClaim UID is set by the API
  server (clients cannot choose it), which generates it with
  k8s.io/apimachinery/pkg/util/uuid.NewUUID(): google/uuid's `uuid.New().String()`,
  a random (version 4) UUID in exactly that form. Version and variant bits are not
  checked: the form is what makes the UID safe as a file name, and an API server
  with another generator may set other bits.
- namespace: a DNS-1123 label (at most 63 characters), as the API server requires.
- name: a DNS-1123 subdomain (at most 253 characters), as the API server requires
  of ResourceClaim names.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from driver.errors import DriverError, transient
from driver.observability import metrics
from driver.observability.logs import request_scope
from driver.proto.dra.v1 import api_pb2 as v1
from driver.proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver.proto.dra.v1beta1 import api_pb2 as v1beta1
from driver.proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from driver.state.request import ClaimRef, PrepareResult

log = logging.getLogger(__name__)

MAX_CLAIMS_PER_CALL = 1024

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL = re.compile(_LABEL)
_DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_SHOWN = 64  # characters of a bad value quoted in the error


def _show(value: str) -> str:
    """The value as a JSON string (control characters escaped), long ones cut short."""
    if len(value) <= _SHOWN:
        return json.dumps(value)
    return f"{json.dumps(value[:_SHOWN])}... ({len(value)} characters)"


def claim_field_error(namespace: str, uid: str, name: str) -> tuple[str, str] | None:
    """(field, problem) for the first bad field of one claim reference, or None."""
    for field, value in (("namespace", namespace), ("uid", uid), ("name", name)):
        if not value:
            return field, "required value"
    if len(namespace) > DNS1123_LABEL_MAX:
        return "namespace", f"{_show(namespace)} is longer than {DNS1123_LABEL_MAX} characters"
    if not _DNS1123_LABEL.fullmatch(namespace):
        return "namespace", (
            f"{_show(namespace)} is not a DNS-1123 label (lowercase letters, digits and "
            "'-', starting and ending with a letter or digit)"
        )
    if not _UID.fullmatch(uid):
        return "uid", f"{_show(uid)} is not a UID (a lowercase 8-4-4-4-12 hex UUID)"
    if len(name) > DNS1123_SUBDOMAIN_MAX:
        return "name", f"{_show(name)} is longer than {DNS1123_SUBDOMAIN_MAX} characters"
    if not _DNS1123_SUBDOMAIN.fullmatch(name):
        return "name", (
            f"{_show(name)} is not a DNS-1123 subdomain (lowercase letters, digits, '-' "
            "and '.', each dot-separated part starting and ending with a letter or digit)"
        )
    return None


class ClaimPreparer(Protocol):
    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]: ...
    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]: ...


def _claim_refs(claims: Sequence[Any], context: grpc.ServicerContext) -> list[ClaimRef]:
    if len(claims) > MAX_CLAIMS_PER_CALL:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"claims: {len(claims)} claims in one call, at most {MAX_CLAIMS_PER_CALL}",
        )
    refs: dict[str, ClaimRef] = {}  # one answer per UID: the response is a map
    for i, claim in enumerate(claims):
        problem = claim_field_error(claim.namespace, claim.uid, claim.name)
        if problem is not None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"claims[{i}].{problem[0]}: {problem[1]}"
            )
        refs.setdefault(
            claim.uid, ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
        )
    return list(refs.values())


class _ClaimNames:
    """`namespace/name, ...` of the claims, formatted only when a log line is written."""

    def __init__(self, refs: Sequence[ClaimRef]) -> None:
        self._refs = refs

    def __str__(self) -> str:
        return ", ".join(f"{r.namespace}/{r.name}" for r in self._refs)


class DraService:
    """One implementation, registered under both the v1 and v1beta1 service names.
    `serving_instead()` names the newer plugin instance that serves the node when
    this one has yielded to it (driver.plugin.serving_instance), else None: a yielded
    instance prepares nothing, since the claims it is asked for may have been
    allocated against what the newer one published; its answer is an error the
    kubelet retries, and the retry reaches the newer instance."""

    def __init__(
        self, state: ClaimPreparer, serving_instead: Callable[[], object | None] = lambda: None
    ) -> None:
        self._state = state
        self._serving_instead = serving_instead

    def prepare(self, request: Any, context: grpc.ServicerContext, pb: Any) -> Any:
        if not request.claims:  # the readiness probe's (driver.plugin.readiness)
            return pb.NodePrepareResourcesResponse()
        with (
            request_scope("prepare"),
            metrics.REQUESTS_IN_FLIGHT.labels("prepare").track_inprogress(),
        ):
            started = time.monotonic()
            refs = _claim_refs(request.claims, context)
            log.info("NodePrepareResources: %s", _ClaimNames(refs))
            newer = self._serving_instead()
            if newer is None:
                results = self._state.prepare(refs)
            else:
                refused = transient(
                    f"plugin instance {newer} serves this node now and this one has yielded "
                    "to it; the kubelet's retry reaches it"
                )
                results = {ref.uid: PrepareResult(error=refused) for ref in refs}
            response = pb.NodePrepareResourcesResponse()
            for ref in refs:
                result = results[ref.uid]
                entry = response.claims[ref.uid]
                outcome = "ok" if result.error is None else result.error.error_class.value
                metrics.PREPARE_REQUESTS.labels(outcome=outcome).inc()
                if result.error is not None:
                    entry.error = str(result.error)
                    if result.error.permanent:
                        entry.error_type = pb.Permanent
                    log.warning("prepare %s/%s failed: %s", ref.namespace, ref.name, result.error)
                    continue
                for device in result.devices:
                    out = entry.devices.add(
                        request_names=list(device.request_names),
                        pool_name=device.pool_name,
                        device_name=device.device_name,
                        cdi_device_ids=list(device.cdi_device_ids),
                    )
                    if device.share_id and pb is v1:
                        out.share_id = device.share_id
            metrics.PREPARE_SECONDS.observe(time.monotonic() - started)
            return response

    def unprepare(self, request: Any, context: grpc.ServicerContext, pb: Any) -> Any:
        with (
            request_scope("unprepare"),
            metrics.REQUESTS_IN_FLIGHT.labels("unprepare").track_inprogress(),
        ):
            refs = _claim_refs(request.claims, context)
            log.info("NodeUnprepareResources: %s", _ClaimNames(refs))
            results = self._state.unprepare(refs)
            response = pb.NodeUnprepareResourcesResponse()
            for ref in refs:
                error = results[ref.uid]
                metrics.UNPREPARE_REQUESTS.labels(outcome="ok" if error is None else "error").inc()
                response.claims[ref.uid].error = "" if error is None else str(error)
            return response


class V1Servicer(v1_grpc.DRAPluginServicer):
    """`DraService` under the v1 names; `V1beta1Servicer` under the v1beta1 ones."""

    pb: Any = v1

    def __init__(self, service: DraService) -> None:
        self._service = service

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._service.prepare(request, context, self.pb)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._service.unprepare(request, context, self.pb)


class V1beta1Servicer(V1Servicer):
    pb = v1beta1


def add_dra_services(
    server: grpc.Server,
    state: ClaimPreparer,
    serving_instead: Callable[[], object | None] = lambda: None,
) -> None:
    service = DraService(state, serving_instead)
    v1_grpc.add_DRAPluginServicer_to_server(V1Servicer(service), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(V1beta1Servicer(service), server)
