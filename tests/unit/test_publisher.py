"""SlicePublisher reconcile logic against an in-memory API server."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from driver.kube.api import ApiError
from driver.kube.feature_gates import DroppedFieldsError
from driver.kube.publisher import SLICES_PATH, SlicePublisher
from driver.kube.slice_compare import comparable_spec, slice_index

NODE = "node-a"
DRIVER = "gpu.example.com"


class FakeApi:
    """Stores ResourceSlices like the API server does (names, uids, resourceVersions)."""

    def __init__(self, drops: tuple[str, ...] = ()) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.dry_runs = 0
        self._ids = itertools.count(1)
        # Fields this server drops as one with their feature gate off does: slice
        # fields ("sharedCounters") and device fields ("devices[].taints").
        self._drops = drops

    def _stored(self, body: Any) -> Any:
        obj = copy.deepcopy(body)
        for name in self._drops:
            if name.startswith("devices[]."):
                for device in obj["spec"].get("devices") or []:
                    device.pop(name.removeprefix("devices[]."), None)
            else:
                obj["spec"].pop(name, None)
        return obj

    def request(
        self, method: str, path: str, *, query: Any = None, body: Any = None, **_: Any
    ) -> Any:
        if method == "GET" and path == f"/api/v1/nodes/{NODE}":
            return {"metadata": {"name": NODE, "uid": "node-uid"}}
        if method == "GET":
            return {
                "metadata": {"resourceVersion": "1"},
                "items": copy.deepcopy(list(self.slices.values())),
            }
        if (query or {}).get("dryRun") == "All":  # answered as stored, never stored
            assert method == "POST"
            self.dry_runs += 1
            return self._stored(body)
        self.writes.append((method, path))
        n = next(self._ids)
        if method == "POST":
            obj = self._stored(body)
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
            obj = self._stored(body)
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
    assert [slice_index(n) for n in sorted(api.slices)] == [0, 1]


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
    a: dict[str, Any] = {
        "pool": {"generation": 1},
        "sharedCounters": [{"name": "s", "counters": {"memory": {"value": "1Gi"}}}],
    }
    b: dict[str, Any] = {
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
    pub._watch.run = lambda: None  # type: ignore[method-assign]
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


# -- fields that only a feature gate keeps ---------------------------------------------

COUNTER_SET = {"name": "gpu-0-counter-set", "counters": {"memory": {"value": "80Gi"}}}
CONSUMES = [{"counterSet": "gpu-0-counter-set", "counters": {"memory": {"value": "10Gi"}}}]


def partitioned_pool() -> list[dict[str, Any]]:
    counters = {**spec(), "sharedCounters": [COUNTER_SET]}
    del counters["devices"]
    return [counters, spec(device("gpu-0-mig-1g10gb-0", consumesCounters=CONSUMES))]


def test_a_server_without_partitionable_devices_fails_the_publish_storing_nothing() -> None:
    api = FakeApi(drops=("sharedCounters", "devices[].consumesCounters"))
    with pytest.raises(DroppedFieldsError) as exc:
        publisher(api, partitioned_pool()).reconcile()
    message = str(exc.value)
    assert "DRAPartitionableDevices" in message and "Kubernetes 1.36" in message
    assert "Counters (1) of ResourceSlice" in message and "overlapping" in message
    assert exc.value.gates == ("DRAPartitionableDevices",)
    # The dry run found it: no slice without its counters reached the store.
    assert api.slices == {} and api.writes == [] and api.dry_runs >= 1


def test_the_dry_run_is_done_once_and_a_server_with_the_gates_is_written(api: FakeApi) -> None:
    desired = partitioned_pool()
    pub = publisher(api, desired)
    pub.reconcile()
    assert len(api.slices) == 2 and api.dry_runs == 2
    desired[1] = spec(device("gpu-0-mig-1g10gb-0", consumesCounters=CONSUMES, taints=TAINT))
    pub.reconcile()
    assert api.dry_runs == 2  # later writes are checked by their answers


TAINT = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]


def test_a_dropped_taint_fails_a_later_publish_naming_its_gate() -> None:
    api = FakeApi(drops=("devices[].taints",))
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = publisher(api, desired)
    pub.reconcile()  # no taint yet: nothing to drop
    desired[1] = spec(device("gpu-1", taints=TAINT))
    with pytest.raises(DroppedFieldsError, match="DRADeviceTaints") as exc:
        pub.reconcile()
    assert "devices[].taints (1)" in str(exc.value)


def test_a_default_false_allow_multiple_allocations_may_be_dropped() -> None:
    api = FakeApi(drops=("devices[].allowMultipleAllocations",))
    pub = publisher(api, [spec(device("gpu-0", allowMultipleAllocations=False))])
    pub.reconcile()
    shared = spec(device("gpu-0", allowMultipleAllocations=True))
    with pytest.raises(DroppedFieldsError, match="DRAConsumableCapacity"):
        publisher(FakeApi(drops=("devices[].allowMultipleAllocations",)), [shared]).reconcile()


def test_the_background_loop_reports_the_gate_until_it_is_on() -> None:
    api = FakeApi(drops=("sharedCounters", "devices[].consumesCounters"))
    pub = publisher(api, partitioned_pool())
    pub._watch.run = lambda: None  # type: ignore[method-assign]
    pub.start()
    try:
        assert not pub.wait_synced(pub.trigger(), timeout=1)
        assert pub.stats.failing is not None and "DRAPartitionableDevices" in pub.stats.failing
    finally:
        pub.stop()
