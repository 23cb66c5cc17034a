"""Helpers of the reliability suite: allocated claims, plugin instances driven like the
kubelet, direct gRPC calls to one instance, and the local-state invariants."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from driver.kube.api import ApiError, KubeApi
from driver.proto.dra.v1 import api_pb2 as dra
from driver.proto.dra.v1 import api_pb2_grpc as dra_grpc
from driver.state.cdi import CdiSpecs
from driver.state.checkpoint import Checkpoint, ClaimState
from tests.conftest import Cluster, FakeNode
from tests.integration.kubelet_standin import ClaimRef, KubeletStandin, RegisteredPlugin
from tests.integration.plugin_process import DRIVER, PluginProcess

# The kubelet-like directories of every plugin started (PluginProcess may keep them
# outside its root); the `root` fixture removes them.
PLUGIN_DIRS: set[Path] = set()

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"


def api_for(cluster: Cluster) -> KubeApi:
    return KubeApi.from_kubeconfig(str(cluster.kubeconfig))


def ensure_namespace(api: KubeApi, ns: str) -> None:
    try:
        api.request(
            "POST",
            "/api/v1/namespaces",
            body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        )
    except ApiError as err:
        if not err.conflict:
            raise


def allocated_claim(api: KubeApi, node: str, ns: str, name: str, device: str) -> ClaimRef:
    """A claim allocated to `device` of `node`'s pool: the allocation is written into the
    status as the scheduler would (no pod, no reservation, no finalizer, so the
    resourceclaim controller leaves it alone)."""
    path = CLAIMS.format(ns=ns)
    try:
        api.request("DELETE", f"{path}/{name}")
    except ApiError as err:
        if not err.not_found:
            raise
    deadline = time.monotonic() + 30
    while True:
        try:
            api.request("GET", f"{path}/{name}")
        except ApiError as err:
            if err.not_found:
                break
        if time.monotonic() > deadline:
            raise AssertionError(f"claim {ns}/{name} was not deleted")
        time.sleep(0.1)
    created = api.request(
        "POST",
        path,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]
                }
            },
        },
    )
    created["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
    }
    api.request("PUT", f"{path}/{name}/status", body=created)
    return ClaimRef(ns, created["metadata"]["uid"], name)


@dataclass
class Instance:
    """One plugin process plus a kubelet stand-in watching its registry dir."""

    plugin: PluginProcess
    kubelet: KubeletStandin

    def stop(self) -> None:
        self.kubelet.stop()
        if self.plugin.proc is not None:
            self.plugin.stop()


def start_instance(
    cluster: Cluster,
    node: FakeNode,
    root: Path,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Instance:
    plugin = PluginProcess(
        kubeconfig=cluster.kubeconfig, node_name=node.name, root=root, args=args, env=env
    )
    PLUGIN_DIRS.add(plugin.registry_dir.parent)
    plugin.start()
    kubelet = KubeletStandin(plugin.registry_dir, poll_interval=0.02).start()
    try:
        plugin.wait_serving(timeout=60)
        kubelet.wait_for_plugin(DRIVER, timeout=60)
    except BaseException:
        kubelet.stop()
        plugin.kill()
        raise
    return Instance(plugin, kubelet)


def stub(plugin: RegisteredPlugin) -> dra_grpc.DRAPluginStub:
    assert plugin.service == "v1.DRAPlugin", plugin.service
    return dra_grpc.DRAPluginStub(plugin.channel)


def prepare_request(refs: Iterable[ClaimRef]) -> dra.NodePrepareResourcesRequest:
    return dra.NodePrepareResourcesRequest(
        claims=[dra.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]
    )


def unprepare_request(refs: Iterable[ClaimRef]) -> dra.NodeUnprepareResourcesRequest:
    return dra.NodeUnprepareResourcesRequest(
        claims=[dra.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]
    )


def is_rpc_error(err: BaseException) -> bool:
    return isinstance(err, grpc.RpcError)


# --------------------------------------------------------------------------- invariants


@dataclass
class LocalState:
    completed: dict[str, list[str]]  # claim UID -> device names
    started: set[str]
    specs: set[str]
    temp_files: list[Path]


def local_state(plugin: PluginProcess) -> LocalState:
    entries = Checkpoint(plugin.data_dir).load()  # raises on a corrupt journal
    completed = {
        uid: [d.device_name for d in e.devices]
        for uid, e in entries.items()
        if e.state is ClaimState.PREPARE_COMPLETED
    }
    started = {uid for uid, e in entries.items() if e.state is ClaimState.PREPARE_STARTED}
    specs = set(CdiSpecs(plugin.cdi_root, DRIVER).list_claim_specs())
    temps = [
        p
        for d in (plugin.cdi_root, plugin.data_dir)
        if d.is_dir()
        for p in d.iterdir()
        if ".tmp" in p.name
    ]
    return LocalState(completed, started, specs, temps)


def assert_consistent(plugin: PluginProcess, expected: set[str] | None = None) -> LocalState:
    """CDI specs == completed journal entries, nothing half-done left, no device held
    by two claims, every spec parses; and, if given, exactly `expected` prepared."""
    state = local_state(plugin)
    assert not state.started, f"PrepareStarted entries left: {state.started}"
    assert not state.temp_files, f"temp files left: {state.temp_files}"
    assert state.specs == set(state.completed), (
        f"CDI specs {sorted(state.specs)} != completed entries {sorted(state.completed)}"
    )
    held = Counter(d for devices in state.completed.values() for d in devices)
    doubled = {d: n for d, n in held.items() if n > 1}
    assert not doubled, f"devices handed to more than one claim: {doubled}"
    cdi = CdiSpecs(plugin.cdi_root, DRIVER)
    for uid in state.specs:
        spec = cdi.read_claim_spec(uid)
        assert spec is not None and spec.get("devices"), f"CDI spec of {uid} unreadable/empty"
    if expected is not None:
        assert set(state.completed) == expected, (
            f"prepared claims {sorted(state.completed)} != expected {sorted(expected)}"
        )
    return state


def dump_state(plugin: PluginProcess) -> str:
    try:
        return json.dumps(local_state(plugin).__dict__, default=str, indent=1)
    except Exception as err:
        return f"<unreadable: {err}>"
