"""A stand-in for the kubelet's DRA side, for tests only.

The integration tier runs a real control plane but no kubelet (that arrives with the
real node of hack/lib/node.sh). Until then this class plays the kubelet's part
towards a DRA kubelet plugin, mirroring what the kubelet does (k8s 1.37,
pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra):

* **Plugin watcher**: polls the registry directory for socket files (names starting
  with ``.`` are ignored, sub-directories are searched), calls ``GetInfo`` with a 1 s
  deadline, validates ``type == "DRAPlugin"``, the driver name and
  ``supported_versions`` (the first entry this kubelet knows wins, walking the
  plugin's list in the plugin's order), answers ``NotifyRegistrationStatus`` and dials
  the DRA endpoint. A failed attempt is retried about once a second, like the
  kubelet's reconciler. Removing the registration socket deregisters the plugin; a
  socket file replaced by a new one, even between two polls, is registered anew, as
  the kubelet re-registers a plugin whose socket it saw created again (the create
  event updates its desired state's timestamp). A new file is told by inode and
  modification time: a socket bound right after the old one was removed usually gets
  the freed inode number back.
* **DRA calls**: ``prepare``/``unprepare`` send ``NodePrepareResources`` /
  ``NodeUnprepareResources`` over the negotiated service (``v1.DRAPlugin``, or
  ``v1beta1.DRAPlugin`` when the plugin lists that first) with the kubelet's 45 s
  deadline, and reject responses that leave out a claim or add an unknown one.
* **Pods**: ``prepare_pod``/``unprepare_pod`` resolve a pod's ResourceClaims (direct
  or from a template via ``status.resourceClaimStatuses``), require an allocation
  reserved for the pod, group the claims by driver and call each driver once.
* **Health**: ``watch_health`` opens ``NodeWatchResources`` (``v1`` preferred,
  ``v1alpha1`` accepted, as the 1.37 kubelet does) and collects the streamed messages.

What it does not do: checkpointing, the 30 s slice wiping after deregistration, CDI
injection into containers, pod status. Those need the real kubelet.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from driver.kube.api import ApiError, KubeApi
from driver.proto.dra.v1 import api_pb2 as dra_v1
from driver.proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from driver.proto.dra.v1beta1 import api_pb2 as dra_v1beta1
from driver.proto.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from driver.proto.dra_health.v1 import api_pb2 as health_v1
from driver.proto.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from driver.proto.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from driver.proto.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from driver.proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

DRA_PLUGIN_TYPE = "DRAPlugin"
V1_SERVICE = "v1.DRAPlugin"
V1BETA1_SERVICE = "v1beta1.DRAPlugin"
# What a 1.37 kubelet supports, in its own preference order (only used for validation;
# the choice follows the plugin's order).
KUBELET_DRA_SERVICES: tuple[str, ...] = (V1_SERVICE, V1BETA1_SERVICE)
HEALTH_V1 = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"

GET_INFO_TIMEOUT = 1.0  # seconds, the kubelet's pluginwatcher deadline
PREPARE_TIMEOUT = 45.0  # seconds, the kubelet's defaultClientCallTimeout
RETRY_INTERVAL = 1.0  # seconds, the kubelet's reconciler period

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class KubeletStandinError(Exception):
    """A kubelet-side failure: registration refused, gRPC error, bad response."""


class ClaimRef(NamedTuple):
    """What the kubelet sends per claim: namespace, UID and name."""

    namespace: str
    uid: str
    name: str


@dataclass
class RegisteredPlugin:
    """One registered plugin instance (a driver may have several during an update)."""

    name: str
    registration_socket: str
    endpoint: str
    supported_versions: list[str]
    service: str  # the negotiated DRA service, e.g. "v1.DRAPlugin"
    channel: grpc.Channel
    registered_at: float = field(default_factory=time.monotonic)
    # (inode, mtime) of the registration socket GetInfo was asked on
    socket_identity: tuple[int, int] | None = None

    @property
    def health_service(self) -> str | None:
        if HEALTH_V1 in self.supported_versions:
            return HEALTH_V1
        if HEALTH_V1ALPHA1 in self.supported_versions:
            return HEALTH_V1ALPHA1
        return None


@dataclass
class RegistrationAttempt:
    """The outcome of one registration attempt, successful or not (for assertions)."""

    socket: str
    ok: bool
    error: str = ""
    notified: bool = False  # whether NotifyRegistrationStatus reached the plugin
    info: reg_pb2.PluginInfo | None = None
    at: float = field(default_factory=time.monotonic)  # when the attempt began


def choose_service(supported_versions: Sequence[str]) -> str | None:
    """The kubelet's rule: first entry of the plugin's list that the kubelet knows."""
    for version in supported_versions:
        if version in KUBELET_DRA_SERVICES:
            return version
    return None


def validate_plugin_info(info: reg_pb2.PluginInfo) -> str:
    """Validate a GetInfo answer like the kubelet; return the chosen DRA service."""
    if info.type != DRA_PLUGIN_TYPE:
        raise KubeletStandinError(f"no handler registered for plugin type: {info.type!r}")
    if not info.name:
        raise KubeletStandinError("plugin name is empty")
    if len(info.name) > 253 or not _DNS_SUBDOMAIN.match(info.name):
        raise KubeletStandinError(f"plugin name {info.name!r} is not a DNS subdomain")
    service = choose_service(list(info.supported_versions))
    if service is None:
        raise KubeletStandinError(
            f"none of the services supported by plugin {info.name!r} "
            f"{list(info.supported_versions)} are supported by the kubelet "
            f"{list(KUBELET_DRA_SERVICES)}"
        )
    return service


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False


def _identity(path: str) -> tuple[int, int] | None:
    """Which file is at `path`: inode and modification time (set when a socket is bound;
    a chmod leaves it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _unix_target(path: str) -> str:
    return path if path.startswith("unix:") else f"unix:{path}"


class HealthWatch:
    """A NodeWatchResources stream read on a thread; messages pile up in ``messages``."""

    def __init__(self, plugin: RegisteredPlugin, service: str) -> None:
        self.service = service
        self.messages: list[Any] = []
        self.error: grpc.RpcError | None = None
        self._cond = threading.Condition()
        if service == HEALTH_V1:
            stub: Any = health_v1_grpc.DRAResourceHealthStub(plugin.channel)
            request: Any = health_v1.NodeWatchResourcesRequest()
        else:
            stub = health_v1alpha1_grpc.DRAResourceHealthStub(plugin.channel)
            request = health_v1alpha1.NodeWatchResourcesRequest()
        self._call = stub.NodeWatchResources(request)
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._call:
                with self._cond:
                    self.messages.append(msg)
                    self._cond.notify_all()
        except grpc.RpcError as err:
            with self._cond:
                if err.code() != grpc.StatusCode.CANCELLED:
                    self.error = err
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[Any]], bool], timeout: float = 30.0) -> list[Any]:
        """Wait until ``predicate(messages)`` holds; return a copy of the messages."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.messages):
                if self.error is not None:
                    raise KubeletStandinError(f"health stream failed: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KubeletStandinError(
                        f"health stream: condition not met in {timeout}s; "
                        f"{len(self.messages)} messages received"
                    )
                self._cond.wait(left)
            return list(self.messages)

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)


class KubeletStandin:
    """Test stand-in for the kubelet's plugin watcher and DRA manager.

    ``api_client`` (a ``driver.kube.api.KubeApi``) is only needed for the pod
    helpers and :meth:`delete_node_slices`.
    """

    def __init__(
        self,
        registry_dir: str | os.PathLike[str],
        *,
        api_client: KubeApi | None = None,
        node_name: str | None = None,
        poll_interval: float = 0.1,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.api_client = api_client
        self.node_name = node_name
        self.poll_interval = poll_interval
        self.attempts: list[RegistrationAttempt] = []
        self._plugins: dict[str, RegisteredPlugin] = {}  # by registration socket
        self._last_failure: dict[str, float] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._health: list[HealthWatch] = []

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> KubeletStandin:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="plugin-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for watch in self._health:
            watch.close()
        with self._cond:
            for plugin in self._plugins.values():
                plugin.channel.close()
            self._plugins.clear()

    def __enter__(self) -> KubeletStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- plugin watcher ---------------------------------------------------------------

    def _sockets(self) -> set[str]:
        found: set[str] = set()
        for root, dirs, files in os.walk(self.registry_dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if name.startswith("."):
                    continue
                path = Path(root, name)
                if _is_socket(path):
                    found.add(str(path))
        return found

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan_once()
            except Exception as err:  # keep watching, like the kubelet
                self.attempts.append(RegistrationAttempt(socket="", ok=False, error=repr(err)))
            self._stop.wait(self.poll_interval)

    def scan_once(self) -> None:
        """One reconcile pass: register new sockets, deregister removed ones."""
        present = self._sockets()
        with self._cond:
            gone = [
                s
                for s, p in self._plugins.items()
                if s not in present or _identity(s) != p.socket_identity
            ]
            for sock in gone:
                self._plugins.pop(sock).channel.close()
            if gone:
                self._cond.notify_all()
            known = set(self._plugins)
        for sock in self._last_failure.keys() - present:
            del self._last_failure[sock]
        now = time.monotonic()
        for sock in sorted(present - known):
            last = self._last_failure.get(sock)
            if last is not None and now - last < RETRY_INTERVAL:
                continue
            self._register(sock)

    def _register(self, sock: str) -> None:
        attempt = RegistrationAttempt(socket=sock, ok=False)
        identity = _identity(sock)
        channel = grpc.insecure_channel(_unix_target(sock))
        try:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except grpc.RpcError as err:
                attempt.error = f"GetInfo: {err.code().name}: {err.details()}"
                return
            attempt.info = info
            try:
                service = validate_plugin_info(info)
                endpoint = info.endpoint or sock
                with self._cond:
                    for other in self._plugins.values():
                        if other.name == info.name and other.endpoint == endpoint:
                            raise KubeletStandinError(
                                f"DRA plugin {info.name!r} with endpoint {endpoint!r} "
                                "is already registered"
                            )
            except KubeletStandinError as err:
                attempt.error = str(err)
                self._notify(stub, attempt, registered=False, error=str(err))
                return
            plugin = RegisteredPlugin(
                name=info.name,
                registration_socket=sock,
                endpoint=endpoint,
                supported_versions=list(info.supported_versions),
                service=service,
                channel=grpc.insecure_channel(_unix_target(endpoint)),
                socket_identity=identity,
            )
            if not self._notify(stub, attempt, registered=True):
                plugin.channel.close()
                return
            with self._cond:
                self._plugins[sock] = plugin
                self._cond.notify_all()
            attempt.ok = True
        finally:
            channel.close()
            if not attempt.ok:
                self._last_failure[sock] = time.monotonic()
            self.attempts.append(attempt)

    def _notify(
        self, stub: Any, attempt: RegistrationAttempt, *, registered: bool, error: str = ""
    ) -> bool:
        try:
            stub.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=registered, error=error),
                timeout=GET_INFO_TIMEOUT,
            )
        except grpc.RpcError as err:
            attempt.error = attempt.error or f"NotifyRegistrationStatus: {err.code().name}"
            return False
        attempt.notified = True
        return True

    # --- registered plugins -----------------------------------------------------------

    @property
    def plugins(self) -> dict[str, RegisteredPlugin]:
        """Registered instances, keyed by registration socket path."""
        with self._cond:
            return dict(self._plugins)

    def plugin(self, driver: str) -> RegisteredPlugin:
        """The instance the kubelet would call: the most recently registered one."""
        with self._cond:
            candidates = [p for p in self._plugins.values() if p.name == driver]
        if not candidates:
            raise KubeletStandinError(
                f"DRA driver {driver} is not registered (registered: "
                f"{sorted({p.name for p in self.plugins.values()})}; "
                f"last attempts: {[(a.socket, a.error) for a in self.attempts[-3:]]})"
            )
        return max(candidates, key=lambda p: p.registered_at)

    def wait_for_plugin(self, driver: str, timeout: float = 30.0) -> RegisteredPlugin:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if any(p.name == driver for p in self._plugins.values()):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
        return self.plugin(driver)

    def registrations_since(self, socket: str | os.PathLike[str], since: float) -> int:
        """Successful registrations (GetInfo, validation, NotifyRegistrationStatus
        with plugin_registered=true) through `socket` that began after `since`
        (time.monotonic())."""
        path = str(socket)
        return sum(1 for a in list(self.attempts) if a.ok and a.socket == path and a.at > since)

    def wait_for_deregistration(self, driver: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(p.name == driver for p in self._plugins.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KubeletStandinError(f"DRA driver {driver} still registered")
                self._cond.wait(min(left, 0.5))

    # --- DRA calls ----------------------------------------------------------------------

    def _stub_and_messages(self, plugin: RegisteredPlugin) -> tuple[Any, Any]:
        if plugin.service == V1_SERVICE:
            return dra_v1_grpc.DRAPluginStub(plugin.channel), dra_v1
        return dra_v1beta1_grpc.DRAPluginStub(plugin.channel), dra_v1beta1

    @staticmethod
    def _check_uids(what: str, claims: Sequence[ClaimRef], got: Iterable[str]) -> None:
        wanted = {c.uid for c in claims}
        got_set = set(got)
        if unknown := got_set - wanted:
            raise KubeletStandinError(f"{what}: response for unknown claim UIDs {sorted(unknown)}")
        if missing := wanted - got_set:
            raise KubeletStandinError(
                f"{what}: skipped {len(missing)} ResourceClaims {sorted(missing)}"
            )

    def prepare(
        self,
        driver: str,
        claims: Sequence[ClaimRef | tuple[str, str, str]],
        timeout: float = PREPARE_TIMEOUT,
    ) -> dict[str, dra_v1.NodePrepareResourceResponse]:
        """NodePrepareResources for ``claims`` ((namespace, uid, name) each).

        Returns the per-claim responses keyed by UID, as v1 messages whatever service
        was negotiated. Per-claim ``error`` strings are left for the caller to check.
        """
        refs = [ClaimRef(*c) for c in claims]
        plugin = self.plugin(driver)
        stub, msgs = self._stub_and_messages(plugin)
        request = msgs.NodePrepareResourcesRequest(
            claims=[msgs.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in refs]
        )
        try:
            response = stub.NodePrepareResources(request, timeout=timeout)
        except grpc.RpcError as err:
            raise KubeletStandinError(
                f"NodePrepareResources ({plugin.service}) failed: "
                f"{err.code().name}: {err.details()}"
            ) from err
        if msgs is not dra_v1:
            response = dra_v1.NodePrepareResourcesResponse.FromString(response.SerializeToString())
        self._check_uids("NodePrepareResources", refs, response.claims.keys())
        return dict(response.claims)

    def unprepare(
        self,
        driver: str,
        claims: Sequence[ClaimRef | tuple[str, str, str]],
        timeout: float = PREPARE_TIMEOUT,
    ) -> dict[str, dra_v1.NodeUnprepareResourceResponse]:
        """NodeUnprepareResources for ``claims``; per-claim responses keyed by UID."""
        refs = [ClaimRef(*c) for c in claims]
        plugin = self.plugin(driver)
        stub, msgs = self._stub_and_messages(plugin)
        request = msgs.NodeUnprepareResourcesRequest(
            claims=[msgs.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in refs]
        )
        try:
            response = stub.NodeUnprepareResources(request, timeout=timeout)
        except grpc.RpcError as err:
            raise KubeletStandinError(
                f"NodeUnprepareResources ({plugin.service}) failed: "
                f"{err.code().name}: {err.details()}"
            ) from err
        if msgs is not dra_v1:
            response = dra_v1.NodeUnprepareResourcesResponse.FromString(
                response.SerializeToString()
            )
        self._check_uids("NodeUnprepareResources", refs, response.claims.keys())
        return dict(response.claims)

    # --- health -------------------------------------------------------------------------

    def watch_health(self, driver: str) -> HealthWatch:
        """Open the plugin's health stream (v1 preferred, v1alpha1 accepted)."""
        plugin = self.plugin(driver)
        service = plugin.health_service
        if service is None:
            raise KubeletStandinError(
                f"DRA driver {driver} advertises no health service: {plugin.supported_versions}"
            )
        watch = HealthWatch(plugin, service)
        self._health.append(watch)
        return watch

    # --- pods (needs api_client) ----------------------------------------------------------

    def _api(self, method: str, path: str, query: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
        """A JSON request through ``api_client``."""
        if self.api_client is None:
            raise KubeletStandinError("KubeletStandin needs api_client for API calls")
        try:
            return self.api_client.request(method, path, query=dict(query))
        except ApiError as err:
            raise KubeletStandinError(f"{method} {path}: HTTP {err}") from err

    def _get(self, path: str) -> dict[str, Any]:
        return self._api("GET", path)

    def pod_claims(self, namespace: str, pod_name: str) -> dict[str, list[ClaimRef]]:
        """The pod's ResourceClaims grouped by driver, as the kubelet resolves them.

        Requires every claim to exist, be allocated and be reserved for the pod.
        """
        pod = self._get(f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
        pod_uid = pod["metadata"]["uid"]
        if self.node_name and pod.get("spec", {}).get("nodeName") != self.node_name:
            raise KubeletStandinError(
                f"pod {namespace}/{pod_name} is not bound to node {self.node_name} "
                f"(nodeName={pod.get('spec', {}).get('nodeName')!r})"
            )
        statuses = {
            s["name"]: s.get("resourceClaimName")
            for s in pod.get("status", {}).get("resourceClaimStatuses") or []
        }
        by_driver: dict[str, list[ClaimRef]] = {}
        for pod_claim in pod.get("spec", {}).get("resourceClaims") or []:
            claim_name = pod_claim.get("resourceClaimName")
            if claim_name is None and pod_claim.get("resourceClaimTemplateName"):
                claim_name = statuses.get(pod_claim["name"])
                if claim_name is None:
                    raise KubeletStandinError(
                        f"pod {namespace}/{pod_name}: claim {pod_claim['name']!r} from a template "
                        "has no generated ResourceClaim yet"
                    )
            if claim_name is None:
                raise KubeletStandinError(
                    f"pod claim {pod_claim!r} names neither claim nor template"
                )
            claim = self._get(
                f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{claim_name}"
            )
            status = claim.get("status") or {}
            allocation = status.get("allocation")
            if not allocation:
                raise KubeletStandinError(
                    f"ResourceClaim {namespace}/{claim_name} is not allocated"
                )
            reserved = status.get("reservedFor") or []
            if not any(r.get("resource") == "pods" and r.get("uid") == pod_uid for r in reserved):
                raise KubeletStandinError(
                    f"ResourceClaim {namespace}/{claim_name} is not reserved for "
                    f"pod {pod_name} ({pod_uid})"
                )
            ref = ClaimRef(namespace, claim["metadata"]["uid"], claim_name)
            drivers = {r["driver"] for r in allocation.get("devices", {}).get("results") or []}
            for driver in sorted(drivers):
                refs = by_driver.setdefault(driver, [])
                if ref not in refs:
                    refs.append(ref)
        return by_driver

    def prepare_pod(
        self, namespace: str, pod_name: str, timeout: float = PREPARE_TIMEOUT
    ) -> dict[str, dict[str, dra_v1.NodePrepareResourceResponse]]:
        """One NodePrepareResources call per driver with all of the pod's claims for it."""
        return {
            driver: self.prepare(driver, refs, timeout=timeout)
            for driver, refs in self.pod_claims(namespace, pod_name).items()
        }

    def unprepare_pod(
        self, namespace: str, pod_name: str, timeout: float = PREPARE_TIMEOUT
    ) -> dict[str, dict[str, dra_v1.NodeUnprepareResourceResponse]]:
        return {
            driver: self.unprepare(driver, refs, timeout=timeout)
            for driver, refs in self.pod_claims(namespace, pod_name).items()
        }

    def delete_node_slices(self, driver: str | None = None) -> None:
        """What the kubelet does at start (all drivers) and 30 s after a driver left."""
        if self.node_name is None:
            raise KubeletStandinError("delete_node_slices needs node_name")
        selector = f"spec.nodeName={self.node_name}"
        if driver:
            selector += f",spec.driver={driver}"
        self._api(
            "DELETE", "/apis/resource.k8s.io/v1/resourceslices", [("fieldSelector", selector)]
        )


@contextlib.contextmanager
def running_standin(
    registry_dir: str | os.PathLike[str], **kwargs: Any
) -> Iterator[KubeletStandin]:
    """``with running_standin(dir) as kubelet: ...``"""
    standin = KubeletStandin(registry_dir, **kwargs).start()
    try:
        yield standin
    finally:
        standin.stop()
