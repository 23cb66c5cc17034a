"""SlicePublisher reconcile logic against an in-memory API server."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from driver.kube.api import ApiError
from driver.kube.publisher import SLICES_PATH, SlicePublisher, comparable_spec, slice_index

NODE = "node-a"
DRIVER = "gpu.example.com"


class FakeApi:
    """Stores ResourceSlices like the API server does (names, uids, resourceVersions)."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self._ids = itertools.count(1)

    def request(self, method: str, path: str, *, query: Any = None, body: Any = None, **_: Any):
        if method == "GET" and path == f"/api/v1/nodes/{NODE}":
            return {"metadata": {"name": NODE, "uid": "node-uid"}}
        if method == "GET":
            return {
                "metadata": {"resourceVersion": "1"},
                "items": copy.deepcopy(list(self.slices.values())),
            }
        self.writes.append((method, path))
        n = next(self._ids)
        if method == "POST":
            obj = copy.deepcopy(body)
            obj["metadata"]["name"] = obj["metadata"].pop("generateName") + f"x{n:04d}"
            obj["metadata"].update(
                uid=f"uid-{n}", resourceVersion=str(n), creationTimestamp=f"t{n:05d}"
            )
            self.slices[obj["metadata"]["name"]] = obj
            return copy.deepcopy(obj)
        name = path.rsplit("/", 1)[1]
        if name not in self.slices:
            raise ApiError(404, "NotFound")
        if method == "PUT":
            obj = copy.deepcopy(body)
            obj["metadata"]["resourceVersion"] = str(n)
            self.slices[name] = obj
            return copy.deepcopy(obj)
        if method == "DELETE":
            del self.slices[name]
            return {}
        raise AssertionError(method)


def device(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"index": {"int": 0}},
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def spec(*devices: dict[str, Any]) -> dict[str, Any]:
    return {
        "driver": DRIVER,
        "nodeName": NODE,
        "pool": {"name": NODE, "generation": 0, "resourceSliceCount": 0},
        "devices": list(devices),
    }


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def publisher(api: FakeApi, desired: list[dict[str, Any]]) -> SlicePublisher:
    return SlicePublisher(api, driver=DRIVER, node_name=NODE, desired=lambda: desired)  # type: ignore[arg-type]


def test_first_reconcile_creates_indexed_slices_owned_by_the_node(api: FakeApi) -> None:
    publisher(api, [spec(device("gpu-0")), spec(device("gpu-1"))]).reconcile()
    names = sorted(api.slices)
    assert [slice_index(n) for n in names] == [0, 1]
    assert names[0].startswith(f"00000-{DRIVER}-{NODE}-")
    for obj in api.slices.values():
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": NODE,
                "uid": "node-uid",
                "controller": True,
            }
        ]
        assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}


def test_resync_without_change_writes_nothing(api: FakeApi) -> None:
    pub = publisher(api, [spec(device("gpu-0")), spec(device("gpu-1"))])
    pub.reconcile()
    writes = len(api.writes)
    for _ in range(3):
        pub.reconcile()
    assert len(api.writes) == writes


def test_quantity_spelling_and_server_stamped_taint_time_are_not_changes(api: FakeApi) -> None:
    tainted = device(
        "gpu-0", taints=[{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
    )
    pub = publisher(api, [spec(tainted)])
    pub.reconcile()
    stored = next(iter(api.slices.values()))
    stored["spec"]["devices"][0]["capacity"]["memory"]["value"] = str(80 * 2**30)
    stored["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-11-21T10:00:00Z"
    stored["metadata"]["resourceVersion"] = "rewritten-by-the-server"
    writes = len(api.writes)
    pub.reconcile()
    assert len(api.writes) == writes


def test_deleted_slice_is_recreated_in_a_new_generation(api: FakeApi) -> None:
    pub = publisher(api, [spec(device("gpu-0")), spec(device("gpu-1"))])
    pub.reconcile()
    victim = sorted(api.slices)[1]
    del api.slices[victim]
    pub.reconcile()
    assert len(api.slices) == 2
    assert {o["spec"]["pool"]["generation"] for o in api.slices.values()} == {2}
    assert sorted(slice_index(n) for n in api.slices) == [0, 1]


def test_one_changed_slice_is_updated_in_place_at_the_same_generation(api: FakeApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = publisher(api, desired)
    pub.reconcile()
    api.writes.clear()
    desired[1] = spec(
        device("gpu-1", taints=[{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}])
    )
    pub.reconcile()
    assert [m for m, _ in api.writes] == ["PUT"]
    assert {o["spec"]["pool"]["generation"] for o in api.slices.values()} == {1}


def test_shrinking_pool_deletes_surplus_and_bumps_generation(api: FakeApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1")), spec(device("gpu-2"))]
    pub = publisher(api, desired)
    pub.reconcile()
    del desired[2]
    pub.reconcile()
    assert len(api.slices) == 2
    assert all(
        o["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 2}
        for o in api.slices.values()
    )


def test_slices_with_foreign_names_are_replaced(api: FakeApi) -> None:
    pub = publisher(api, [spec(device("gpu-0"))])
    api.slices["legacy-name"] = {
        "metadata": {
            "name": "legacy-name",
            "uid": "u",
            "resourceVersion": "1",
            "creationTimestamp": "t0",
        },
        "spec": {
            **spec(device("gpu-0")),
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
        },
    }
    pub.reconcile()
    assert "legacy-name" not in api.slices
    assert len(api.slices) == 1


def test_comparable_spec_ignores_pool_and_normalises_counters() -> None:
    a = {
        "pool": {"generation": 1},
        "sharedCounters": [{"name": "s", "counters": {"memory": {"value": "1Gi"}}}],
    }
    b = {
        "pool": {"generation": 7},
        "sharedCounters": [{"name": "s", "counters": {"memory": {"value": "1073741824"}}}],
    }
    assert comparable_spec(a) == comparable_spec(b)
    b["sharedCounters"][0]["counters"]["memory"]["value"] = "2Gi"
    assert comparable_spec(a) != comparable_spec(b)


def test_background_loop_signals_sync_and_retries_after_api_errors(api: FakeApi) -> None:
    failures = iter([ApiError(503, "ServiceUnavailable")])
    real_request = api.request

    def flaky(method: str, path: str, **kw: Any) -> Any:
        err = next(failures, None) if method == "GET" and path == SLICES_PATH else None
        if err:
            raise err
        return real_request(method, path, **kw)

    api.request = flaky  # type: ignore[method-assign]
    pub = publisher(api, [spec(device("gpu-0"))])
    pub._watch_loop = lambda: None  # type: ignore[method-assign]
    pub.start()
    try:
        assert pub.wait_synced(pub.trigger(), timeout=10)
        assert len(api.slices) == 1
        assert pub.stats.errors and "503" in pub.stats.errors[0]
    finally:
        pub.stop()


def test_changes_in_several_slices_without_moving_devices_stay_in_place(api: FakeApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1")), spec(device("gpu-2"))]
    pub = publisher(api, desired)
    pub.reconcile()
    api.writes.clear()
    taint = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
    desired[0] = spec(device("gpu-0", taints=taint))
    desired[2] = spec(device("gpu-2", taints=taint))
    pub.reconcile()
    assert [m for m, _ in api.writes] == ["PUT", "PUT"]
    assert {o["spec"]["pool"]["generation"] for o in api.slices.values()} == {1}


def test_a_device_moving_between_slices_is_a_new_generation(api: FakeApi) -> None:
    desired = [spec(device("gpu-0"), device("gpu-1")), spec(device("gpu-2"))]
    pub = publisher(api, desired)
    pub.reconcile()
    desired[:] = [spec(device("gpu-0")), spec(device("gpu-1"), device("gpu-2"))]
    pub.reconcile()
    assert {o["spec"]["pool"]["generation"] for o in api.slices.values()} == {2}
    names = sorted(api.slices)
    assert [d["name"] for d in api.slices[names[1]]["spec"]["devices"]] == ["gpu-1", "gpu-2"]


def test_a_slice_changed_by_someone_else_is_written_back(api: FakeApi) -> None:
    pub = publisher(api, [spec(device("gpu-0"))])
    pub.reconcile()
    stored = next(iter(api.slices.values()))
    stored["spec"]["devices"][0]["attributes"]["index"] = {"int": 42}
    stored["metadata"]["resourceVersion"] = "edited"
    api.writes.clear()
    pub.reconcile()
    assert [m for m, _ in api.writes] == ["PUT"]
    assert next(iter(api.slices.values()))["spec"]["devices"][0]["attributes"]["index"] == {
        "int": 0
    }
