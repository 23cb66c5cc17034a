"""ResourceClaim reads, and Events on claims: a permanent failure (with a condition in
the claim's device status where enabled) and a lost MPS daemon (`ClaimEvents`)."""

from __future__ import annotations

import datetime
import logging
from typing import Any

from driver.errors import DriverError, transient
from driver.kube.api import APPLY_PATCH, JSON, KubeApi, segment
from driver.kube.kube_events import event_body
from driver.state.request import ClaimRef

log = logging.getLogger(__name__)

CONDITION_TYPE = "PrepareFailed"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_claim_event(
    api: KubeApi, claim: ClaimRef, reason: str, message: str, *, driver: str, node_name: str
) -> None:
    """A Warning Event on the ResourceClaim, reported by this node."""
    involved = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "name": claim.name,
        "namespace": claim.namespace,
        "uid": claim.uid,
    }
    body = event_body(involved, reason, message, "Warning", driver=driver, node=node_name)
    api.request("POST", f"/api/v1/namespaces/{segment(claim.namespace)}/events", body=body)


class ClaimEvents:
    """Warning Events on claims the journal names (`driver.state.mps_watch`), best
    effort: a failed POST is logged (the log has the same text)."""

    def __init__(self, api: KubeApi, *, driver: str, node_name: str) -> None:
        self._api = api
        self._driver = driver
        self._node = node_name

    def post(self, claim: ClaimRef, reason: str, message: str) -> None:
        try:
            post_claim_event(
                self._api, claim, reason, message, driver=self._driver, node_name=self._node
            )
        except Exception as err:
            log.warning(
                "could not post the %s event on claim %s/%s: %s",
                reason,
                claim.namespace,
                claim.name,
                err,
            )


class ApiClaimReader:
    def __init__(self, api: KubeApi) -> None:
        self._api = api

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self._api.request(
                "GET",
                f"/apis/resource.k8s.io/v1/namespaces/{segment(namespace)}"
                f"/resourceclaims/{segment(name)}",
            )
        except Exception as err:  # an API error, or connection refused, timeouts
            raise transient(f"reading ResourceClaim {namespace}/{name}: {err}") from err


class ClaimFailureReporter:
    """An Event on the claim for every permanent verdict; with device status enabled,
    also a `PrepareFailed` condition on each of the claim's devices of this driver."""

    def __init__(self, api: KubeApi, *, driver: str, node_name: str, device_status: bool) -> None:
        self._api = api
        self._driver = driver
        self._node = node_name
        self._device_status = device_status

    def permanent_failure(self, claim: dict[str, Any], error: DriverError) -> None:
        try:
            meta = claim["metadata"]
            post_claim_event(
                self._api,
                ClaimRef(meta["namespace"], meta["name"], meta["uid"]),
                "PermanentPrepareFailure",
                str(error),
                driver=self._driver,
                node_name=self._node,
            )
            if self._device_status:
                self._condition(claim, error)
        except Exception as err:  # visibility is best effort; the verdict still stands
            log.warning("could not report the permanent failure on the claim: %s", err)

    def _condition(self, claim: JSON, error: DriverError) -> None:
        meta = claim["metadata"]
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
        devices = [
            {
                "driver": r["driver"],
                "pool": r["pool"],
                "device": r["device"],
                **({"shareID": r["shareID"]} if r.get("shareID") else {}),
                "conditions": [
                    {
                        "type": CONDITION_TYPE,
                        "status": "True",
                        "reason": error.error_class.value.title().replace("-", ""),
                        "message": str(error)[:32768],
                        "lastTransitionTime": _now(),
                    }
                ],
            }
            for r in results.get("results", [])
            if r.get("driver") == self._driver
        ]
        if not devices:
            return
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "status": {"devices": devices},
        }
        self._api.request(
            "PATCH",
            f"/apis/resource.k8s.io/v1/namespaces/{segment(meta['namespace'])}/resourceclaims/"
            f"{segment(meta['name'])}/status",
            query={"fieldManager": self._driver, "force": "true"},
            body=body,
            content_type=APPLY_PATCH,
        )
