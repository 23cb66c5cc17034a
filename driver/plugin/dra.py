"""The kubelet's DRA service (v1 and v1beta1): protobuf in, DeviceState, protobuf out.

Transport only. Per-claim failures travel in the response map with `error_type` set
for permanent ones (KEP-5322); a gRPC error is reserved for a request that cannot be
answered at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from driver.errors import DriverError
from driver.observability import metrics
from driver.observability.logs import request_scope
from driver.proto.dra.v1 import api_pb2 as v1
from driver.proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver.proto.dra.v1beta1 import api_pb2 as v1beta1
from driver.proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from driver.state.claims import ClaimRef, PrepareResult

log = logging.getLogger(__name__)

MAX_CLAIMS_PER_CALL = 1024


class ClaimPreparer(Protocol):
    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]: ...
    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, DriverError | None]: ...


def _claim_refs(claims: Sequence[Any], context: grpc.ServicerContext) -> list[ClaimRef]:
    if len(claims) > MAX_CLAIMS_PER_CALL:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"claims: {len(claims)} claims in one call, at most {MAX_CLAIMS_PER_CALL}",
        )
    refs: list[ClaimRef] = []
    seen: set[str] = set()
    for i, claim in enumerate(claims):
        missing = [f for f in ("namespace", "uid", "name") if not getattr(claim, f)]
        if missing:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"claims[{i}].{missing[0]}: required value"
            )
        if claim.uid in seen:
            continue  # one answer per UID: the response is a map
        seen.add(claim.uid)
        refs.append(ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid))
    return refs


def _outcome(error: DriverError | None) -> str:
    if error is None:
        return "ok"
    return error.error_class.value


class DraService:
    """One implementation, registered under both the v1 and v1beta1 service names."""

    def __init__(self, state: ClaimPreparer) -> None:
        self._state = state

    def prepare(self, request: Any, context: grpc.ServicerContext, pb: Any) -> Any:
        with request_scope("prepare"):
            started = time.monotonic()
            refs = _claim_refs(request.claims, context)
            log.info("NodePrepareResources: %s", ", ".join(f"{r.namespace}/{r.name}" for r in refs))
            results = self._state.prepare(refs)
            response = pb.NodePrepareResourcesResponse()
            for ref in refs:
                result = results[ref.uid]
                entry = response.claims[ref.uid]
                metrics.PREPARE_REQUESTS.labels(outcome=_outcome(result.error)).inc()
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
        with request_scope("unprepare"):
            refs = _claim_refs(request.claims, context)
            log.info(
                "NodeUnprepareResources: %s", ", ".join(f"{r.namespace}/{r.name}" for r in refs)
            )
            results = self._state.unprepare(refs)
            response = pb.NodeUnprepareResourcesResponse()
            for ref in refs:
                error = results[ref.uid]
                metrics.UNPREPARE_REQUESTS.labels(outcome="ok" if error is None else "error").inc()
                response.claims[ref.uid].error = "" if error is None else str(error)
            return response


class V1Servicer(v1_grpc.DRAPluginServicer):
    def __init__(self, service: DraService) -> None:
        self._service = service

    def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodePrepareResourcesResponse:
        response: v1.NodePrepareResourcesResponse = self._service.prepare(request, context, v1)
        return response

    def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodeUnprepareResourcesResponse:
        response: v1.NodeUnprepareResourcesResponse = self._service.unprepare(request, context, v1)
        return response


class V1beta1Servicer(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, service: DraService) -> None:
        self._service = service

    def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodePrepareResourcesResponse:
        response: v1beta1.NodePrepareResourcesResponse = self._service.prepare(
            request, context, v1beta1
        )
        return response

    def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        response: v1beta1.NodeUnprepareResourcesResponse = self._service.unprepare(
            request, context, v1beta1
        )
        return response


def add_dra_services(server: grpc.Server, state: ClaimPreparer) -> None:
    service = DraService(state)
    v1_grpc.add_DRAPluginServicer_to_server(V1Servicer(service), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(V1beta1Servicer(service), server)
