"""Helpers of the reliability suite: allocated claims, plugin instances driven like the
kubelet, direct gRPC calls to one instance, and the local-state invariants."""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

from driver.cdi.claim_specs import CdiSpecs
from driver.devices.model import (
    MigStrategy,
    PoolDevices,
    PoolOptions,
    PublishedDevice,
    build_pool,
)
from driver.kube.api import ApiError, KubeApi
from driver.nvml.mock.fleet import resolve_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.proto.dra.v1 import api_pb2 as dra
from driver.proto.dra.v1 import api_pb2_grpc as dra_grpc
from driver.state.journal.checkpoint import Checkpoint, ClaimEntry, ClaimState
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


def allocated_claim(
    api: KubeApi, node: str, ns: str, name: str, device: str, share_id: str | None = None
) -> ClaimRef:
    """A claim allocated to `device` of `node`'s pool: the allocation is written into the
    status as the scheduler would (no pod, no reservation, no finalizer, so the
    resourceclaim controller leaves it alone). `share_id` makes it one share of a
    multi-allocatable device (the scheduler's `shareID`, a UUID)."""
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
    result = {"request": "gpu", "driver": DRIVER, "pool": node, "device": device}
    if share_id is not None:  # what the scheduler writes for a share: its ID and consumption
        result["shareID"] = share_id
        result["consumedCapacity"] = {"memory": "8Gi", "compute": "10"}
    created["status"] = {
        "allocation": {
            "devices": {"results": [result]},
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


# --------------------------------------------------------------------------- hardware


def _flag(args: Sequence[str], flag: str) -> str | None:
    """The last value of `--flag=value` / `--flag value` in a command line."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


@functools.lru_cache(maxsize=8)
def _pool(
    node_name: str,
    fleet: str | None,
    gpu_partitions: int = 0,
    mig_strategy: str = "auto",
    allow_multiple_allocations: bool = False,
) -> PoolDevices:
    inventory = MockBackend(MockNvml(resolve_fleet(fleet), node_name)).discover()
    options = PoolOptions(
        driver_name=DRIVER,
        gpu_partitions=gpu_partitions,
        mig_strategy=MigStrategy(mig_strategy),
        allow_multiple_allocations=allow_multiple_allocations,
    )
    return build_pool(inventory, options)


def published_pool(plugin: PluginProcess) -> PoolDevices:
    """What `plugin` publishes: `build_pool` over the same mock inventory (node name,
    fleet, partition mode and MIG strategy from its command line and environment, as
    its flags resolve them, sharing included). Each device carries its GPU's UUID, MIG
    profile and placement."""
    env = {**os.environ, **plugin.env}
    fleet = _flag(plugin.args, "--mock-fleet") or env.get("MOCK_FLEET")
    partitions = _flag(plugin.args, "--gpu-partitions") or env.get("GPU_PARTITIONS") or "0"
    strategy = _flag(plugin.args, "--mig-strategy") or env.get("MIG_STRATEGY") or "auto"
    shared = "--gpu-allow-multiple-allocations" in plugin.args or env.get(
        "GPU_ALLOW_MULTIPLE_ALLOCATIONS", ""
    ).lower() in ("1", "true", "yes")
    return _pool(plugin.node_name, fleet, int(partitions), strategy, shared)


def hardware_overlap(a: PublishedDevice, b: PublishedDevice) -> bool:
    """Do two published devices use the same hardware? The same GPU, and either one of
    them is the whole GPU, or both are MIG partitions whose memory-slice ranges
    [start, start+size) intersect, or (partitions without a placement, as with
    --gpu-partitions) they are the same partition."""
    if a.gpu_uuid != b.gpu_uuid:
        return False
    if not a.is_partition or not b.is_partition:
        return True
    if a.placement is None or b.placement is None:
        return a.name == b.name
    (a_start, a_size), (b_start, b_size) = a.placement, b.placement
    return a_start < b_start + b_size and b_start < a_start + a_size


def describe_device(pool: PoolDevices, name: str) -> str:
    """`gpu-1-mig-3g40gb-0 (3g.40gb, memory slices [0, 4) of GPU GPU-…)`."""
    try:
        d = pool.device(name)
    except KeyError:
        return f"{name} (not published by this node)"
    if not d.is_partition:
        return f"{name} (the whole GPU {d.gpu_uuid})"
    if d.placement is None:
        return f"{name} (partition of GPU {d.gpu_uuid})"
    start, size = d.placement
    return f"{name} ({d.profile}, memory slices [{start}, {start + size}) of GPU {d.gpu_uuid})"


class Holding(NamedTuple):
    """One device as a claim holds it: what the journal records and what an
    allocation result says."""

    device: str
    share_id: str | None = None
    admin_access: bool = False


def conflicting(pool: PoolDevices, a: Holding, b: Holding) -> bool:
    """May two claims NOT hold these at the same time? Hardware overlap, except two
    shares (both with a shareID) of one device published with allowMultipleAllocations
    (the API's rule) and admin access (granted alongside the device's users by design)."""
    if a.admin_access or b.admin_access:
        return False
    shared = a.device == b.device and a.share_id and b.share_id
    if shared and pool.device(a.device).multi_allocatable:
        return False
    return hardware_overlap(pool.device(a.device), pool.device(b.device))


def overlap_problems(
    pool: PoolDevices, held: dict[str, tuple[str, Sequence[Holding]]]
) -> list[str]:
    """Every pair of claims (uid -> (label, holdings)) whose holdings conflict."""
    problems: list[str] = []
    for (uid_a, (label_a, devs_a)), (uid_b, (label_b, devs_b)) in itertools.combinations(
        sorted(held.items()), 2
    ):
        for a in devs_a:
            for b in devs_b:
                if conflicting(pool, a, b):
                    problems.append(
                        f"{label_a} ({uid_a}) holds {describe_device(pool, a.device)}"
                        f"{f' share {a.share_id}' if a.share_id else ''} and "
                        f"{label_b} ({uid_b}) holds {describe_device(pool, b.device)}"
                        f"{f' share {b.share_id}' if b.share_id else ''}: the same hardware"
                    )
    return problems


# --------------------------------------------------------------------------- invariants


@dataclass
class LocalState:
    completed: dict[str, list[str]]  # claim UID -> device names
    started: set[str]
    specs: set[str]
    temp_files: list[Path]
    entries: dict[str, ClaimEntry]  # every journal entry, completed or started


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
    return LocalState(completed, started, specs, temps, dict(entries))


def assert_consistent(plugin: PluginProcess, expected: set[str] | None = None) -> LocalState:
    """CDI specs == completed journal entries, nothing half-done left, every spec
    parses and names exactly its entry's devices, every journaled device is one this
    node publishes, no hardware held by two claims (journal entries compared by GPU
    and MIG memory slices, see `conflicting`); and, if given, exactly `expected`
    prepared."""
    state = local_state(plugin)
    assert not state.started, f"PrepareStarted entries left: {state.started}"
    assert not state.temp_files, f"temp files left: {state.temp_files}"
    assert state.specs == set(state.completed), (
        f"CDI specs {sorted(state.specs)} != completed entries {sorted(state.completed)}"
    )
    pool = published_pool(plugin)
    published = {d.name for d in pool.devices}
    for uid, entry in state.entries.items():
        for d in entry.devices:
            assert d.pool_name == plugin.node_name and d.device_name in published, (
                f"claim {uid} holds {d.pool_name}/{d.device_name}, not a device of this node"
            )
    problems = overlap_problems(
        pool,
        {
            uid: (
                f"claim {e.namespace}/{e.name}",
                [Holding(d.device_name, d.share_id, d.admin_access) for d in e.devices],
            )
            for uid, e in state.entries.items()
        },
    )
    assert not problems, "hardware handed to more than one claim:\n" + "\n".join(problems)
    cdi = CdiSpecs(plugin.cdi_root, DRIVER)
    for uid in state.specs:
        spec = cdi.read_claim_spec(uid)
        assert spec is not None and spec.get("devices"), f"CDI spec of {uid} unreadable/empty"
        # The spec exposes exactly the devices the journal says the claim holds: each
        # device's own CDI id (its first; the second is the node-wide common one).
        in_spec = {cdi.qualified(str(d.get("name"))) for d in spec["devices"]}
        in_journal = {d.cdi_device_ids[0] for d in state.entries[uid].devices}
        assert in_spec == in_journal, (
            f"CDI spec of {uid} exposes {sorted(in_spec)}, the journal {sorted(in_journal)}"
        )
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
