"""`MpsDaemons` under Kubernetes (--mps-daemons=kubernetes, docs/mps.md): each
prepared device's MPS control daemon is a Deployment of its own in the driver's
namespace (driver/kube/mps_manifest.py), created at prepare and deleted at unprepare by
the plugin through the API. Owned by nothing, it outlives a restart, upgrade or deletion
of the plugin's pod, and its clients with it: the journal records its name (derived from
the node and the device) and UID, and at start the plugin adopts the Deployment of that
UID or creates it again where it is gone (docs/mps.md, "Lifecycle").

`stop` waits until no pod of it is left (the daemon has quit), so the device's
directories can go and a later daemon never meets an old one. `observe` reads its pod:
another UID than the one recorded, or more restarts of its container, is a daemon
Kubernetes started again (its clients' GPU work lost), which the MPS watch reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any, Protocol

from driver.errors import transient
from driver.kube.api import ApiError, segment
from driver.kube.mps_manifest import DaemonPodSettings, daemon_deployment, deployment_name
from driver.nvml.mps import DaemonDirs
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import KIND_KUBERNETES
from driver.state.mps.shm import ShmBound

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5


class Api(Protocol):
    """`driver.kube.api.KubeApi`'s `request`."""

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str | int] | None = None,
        body: object = None,
    ) -> dict[str, Any]: ...


def _pod_summary(pods: list[dict[str, Any]]) -> str:
    """What the daemon's pods wait for, for the error: `pod x: Pending
    (ErrImagePull: ...)`."""
    parts = []
    for pod in pods:
        status = pod.get("status") or {}
        text = f"pod {pod['metadata']['name']}: {status.get('phase', 'no status')}"
        for container in status.get("containerStatuses") or []:
            state = container.get("state") or {}
            waiting = state.get("waiting") or state.get("terminated")
            if waiting:
                reason, message = waiting.get("reason", ""), waiting.get("message", "")
                text += f" ({reason}{': ' + message[:200] if message else ''})"
        parts.append(text)
    return "; ".join(parts) or "no pod yet"


def _ready(deployment: dict[str, Any]) -> bool:
    """Has the Deployment's current generation a ready replica (its daemon holds the
    limits: the pod's startup probe waited for that)?"""
    status = deployment.get("status") or {}
    return (
        status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
        and int(status.get("readyReplicas") or 0) >= 1
    )


def _current_pod(pods: list[dict[str, Any]]) -> tuple[str, int] | None:
    """The UID and container restarts of the one pod not being deleted, None while
    there is none or more than one (a replacement under way)."""
    current = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if len(current) != 1:
        return None
    (pod,) = current
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    restarts = sum(int(s.get("restartCount") or 0) for s in statuses)
    return str(pod["metadata"].get("uid") or ""), restarts


class KubeDaemons:
    kind = KIND_KUBERNETES
    private_shm = True

    def __init__(
        self,
        api: Api,
        settings: DaemonPodSettings,
        *,
        ready_timeout: float = 40.0,
        gone_timeout: float = 90.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        shm: ShmBound | None = None,
    ) -> None:
        self.api = api
        self.settings = settings
        self.shm = shm  # the tmpfs on each device's shm directory, mounted by the plugin
        self.ready_timeout = ready_timeout
        self.gone_timeout = gone_timeout
        self._clock = clock
        self._sleep = sleep

    @property
    def _deployments(self) -> str:
        return f"/apis/apps/v1/namespaces/{segment(self.settings.namespace)}/deployments"

    def _name(self, record: MpsRecord) -> str:
        return record.deployment or deployment_name(self.settings.node_name, record.directory)

    def _get(self, name: str) -> dict[str, Any] | None:
        try:
            return self.api.request("GET", f"{self._deployments}/{segment(name)}")
        except ApiError as err:
            if err.not_found:
                return None
            raise

    def _pods(self, name: str) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{segment(self.settings.namespace)}/pods"
        found = self.api.request(
            "GET", path, query={"labelSelector": f"{self.settings.label}={name}"}
        )
        return list(found.get("items") or [])

    def _what(self, record: MpsRecord, name: str) -> str:
        return (
            f"its MPS daemon ({record.directory}, GPU {record.gpu_uuid}), "
            f"Deployment {self.settings.namespace}/{name}"
        )

    # -- MpsDaemons --------------------------------------------------------------------

    def start(self, record: MpsRecord, dirs: DaemonDirs) -> MpsRecord:
        name = self._name(record)
        body = daemon_deployment(self.settings, record, dirs)
        try:
            created = self.api.request("POST", self._deployments, body=body)
        except ApiError as err:
            if not err.conflict:
                raise transient(f"creating {self._what(record, name)}: {err}") from err
            # One left in its place (not recorded as this device's): replace it.
            self.stop(record, dirs, any_instance=True)
            try:
                created = self.api.request("POST", self._deployments, body=body)
            except ApiError as again:
                raise transient(f"creating {self._what(record, name)}: {again}") from again
        stamped = replace(record, deployment=name, deployment_uid=created["metadata"]["uid"])
        try:
            self._wait_ready(stamped, name)
        except Exception:
            self.stop(stamped, dirs)
            raise
        log.info("%s is ready", self._what(stamped, name))
        return self.observe(replace(stamped, pod_uid="", pod_restarts=0))

    def _wait_ready(self, record: MpsRecord, name: str) -> None:
        deadline = self._clock() + self.ready_timeout
        while True:
            try:
                current = self._get(name)
            except ApiError as err:
                raise transient(f"reading {self._what(record, name)}: {err}") from err
            if current is None or current["metadata"]["uid"] != record.deployment_uid:
                raise transient(f"{self._what(record, name)} was deleted before it got ready")
            if _ready(current):
                return
            if self._clock() > deadline:
                try:
                    pods = _pod_summary(self._pods(name))
                except ApiError as err:
                    pods = f"its pods cannot be listed: {err}"
                raise transient(
                    f"{self._what(record, name)} did not get ready in "
                    f"{self.ready_timeout:g}s: {pods}"
                )
            self._sleep(POLL_SECONDS)

    def alive(self, record: MpsRecord) -> bool:
        """Its Deployment exists with the recorded UID (the controller restarts a
        pod that dies). An API error counts as alive: it is not recreated blindly."""
        name = self._name(record)
        try:
            current = self._get(name)
        except ApiError as err:
            log.warning("cannot read %s, taken as running: %s", self._what(record, name), err)
            return True
        return current is not None and current["metadata"]["uid"] == record.deployment_uid

    def not_ready(self, record: MpsRecord) -> str | None:
        """What its pod waits for while the Deployment has no ready replica (the
        daemon died and the kubelet restarts its container, or its pod was replaced);
        None when it has one, or when it cannot be read (not reported blindly)."""
        name = self._name(record)
        try:
            current = self._get(name)
            if current is None or _ready(current):
                return None
            pods = _pod_summary(self._pods(name))
        except ApiError as err:
            log.warning("cannot read %s: %s", self._what(record, name), err)
            return None
        return f"its pod is not ready: {pods}"

    def observe(self, record: MpsRecord) -> MpsRecord:
        """The record with its pod's UID and restarts as they are now; unchanged while
        there is no single current pod or its pods cannot be listed."""
        name = self._name(record)
        try:
            current = _current_pod(self._pods(name))
        except ApiError as err:
            log.warning("cannot list the pods of %s: %s", self._what(record, name), err)
            return record
        if current is None or not current[0]:
            return record
        return replace(record, pod_uid=current[0], pod_restarts=current[1])

    def leftovers(self, owned: Collection[MpsRecord]) -> list[str]:
        """The daemon Deployments of this node that none of `owned` names."""
        names = {self._name(r) for r in owned}
        try:
            found = self.api.request(
                "GET", self._deployments, query={"labelSelector": self.settings.label}
            )
        except ApiError as err:
            raise transient(f"listing the MPS daemon Deployments: {err}") from err
        return sorted(
            d["metadata"]["name"]
            for d in found.get("items") or []
            if d["metadata"]["name"] not in names
            and (d.get("spec") or {}).get("template", {}).get("spec", {}).get("nodeName")
            == self.settings.node_name
        )

    def remove(self, leftover: str) -> str:
        what = f"Deployment {self.settings.namespace}/{leftover}"
        self._delete(leftover, what)
        return what

    def stop(
        self, record: MpsRecord, dirs: DaemonDirs, *, any_instance: bool = False
    ) -> str | None:
        """The device's Deployment by its name, whichever UID (`any_instance` or not).
        Raises a transient error (the caller keeps the entry) when it cannot."""
        name = self._name(record)
        deleted = self._delete(name, self._what(record, name))
        return f"Deployment {self.settings.namespace}/{name}" if deleted else None

    def _delete(self, name: str, what: str) -> bool:
        """Deletes Deployment `name` and waits until it and its pods are gone; whether
        there was one to delete."""
        try:
            self.api.request(
                "DELETE", f"{self._deployments}/{segment(name)}",
                body={"propagationPolicy": "Background"},
            )  # fmt: skip
            deleted = True
        except ApiError as err:
            if not err.not_found:
                raise transient(f"deleting {what}: {err}") from err
            deleted = False
        deadline = self._clock() + self.gone_timeout
        while True:
            try:
                gone = self._get(name) is None and not self._pods(name)
            except ApiError as err:
                raise transient(f"waiting for {what} to be gone: {err}") from err
            if gone:
                log.info("%s is gone", what)
                return deleted
            if self._clock() > deadline:
                raise transient(
                    f"{what} was deleted but its pod is not gone after {self.gone_timeout:g}s"
                )
            self._sleep(POLL_SECONDS)
