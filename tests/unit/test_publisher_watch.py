"""SlicePublisher's background loops against an in-memory API server with a watch: a
triggered change is written from the watch's copy of the slices, without a LIST; the
watch's reports of the publisher's own writes cost no LIST; a copy gone stale
costs a LIST, never a failed publish. And `KubeApi`'s two JSON decoders."""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from driver.config.loader import KeyTrackingDict
from driver.kube import publisher
from driver.kube.api import ApiError, KubeApi
from driver.kube.publisher import SLICES_PATH, SlicePublisher
from driver.kube.slice_watch import SliceCache
from tests.unit.test_publisher import DRIVER, NODE, FakeApi, device, spec

TAINT = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
WAIT = 10.0


class WatchedApi(FakeApi):
    """FakeApi plus what the API server does around the watch: every write is reported
    on the watch stream, and an update based on an old resourceVersion is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.events: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self.watching = threading.Event()
        self.delivering = threading.Event()  # cleared: the stream holds its events back
        self.delivering.set()
        self.lists = 0

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        query = kwargs.get("query") or {}
        if method == "GET" and path == SLICES_PATH:
            self.lists += 1
        name = path.rsplit("/", 1)[1]
        if method == "PUT" and name in self.slices:
            sent = kwargs["body"]["metadata"]["resourceVersion"]
            if sent != self.slices[name]["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict")
        gone = copy.deepcopy(self.slices.get(name))
        answer = super().request(method, path, **kwargs)
        if query.get("dryRun") != "All":
            if method == "POST":
                self.events.put(("ADDED", copy.deepcopy(answer)))
            elif method == "PUT":
                self.events.put(("MODIFIED", copy.deepcopy(answer)))
            elif method == "DELETE" and gone is not None:
                self.events.put(("DELETED", gone))
        return answer

    def watch(self, path: str, **_: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        self.watching.set()
        while True:
            event = self.events.get()
            self.delivering.wait(WAIT)
            if event is None:
                self.events.task_done()
                return
            yield event
            self.events.task_done()  # the publisher handled it and asks for the next

    def edit_behind_the_publisher(self, index: int) -> dict[str, Any]:
        """Someone else changes the slice at `index`; returns its stored object."""
        name = sorted(self.slices)[index]
        stored = self.slices[name]
        stored["spec"]["devices"][0]["attributes"]["index"] = {"int": 42}
        stored["metadata"]["resourceVersion"] = f"edited-{time.monotonic_ns()}"
        return stored


@pytest.fixture
def api() -> Iterator[WatchedApi]:
    api = WatchedApi()
    yield api
    api.events.put(None)


def started(api: WatchedApi, desired: list[dict[str, Any]]) -> SlicePublisher:
    pub = SlicePublisher(api, driver=DRIVER, node_name=NODE, desired=lambda: desired)  # type: ignore[arg-type]
    pub.start()
    assert api.watching.wait(WAIT), "the watch never started"
    assert pub.wait_synced(pub.trigger(), WAIT)
    api.events.join()  # the watch saw the first writes
    return pub


def devices_stored(api: FakeApi) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in api.slices.values() for d in s["spec"]["devices"]}


def test_a_taint_change_is_written_without_listing_the_slices_first(api: WatchedApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = started(api, desired)
    try:
        lists, writes = api.lists, len(api.writes)
        desired[1] = spec(device("gpu-1", taints=TAINT))
        assert pub.wait_synced(pub.trigger(), WAIT)
        assert api.lists == lists, "the reconcile listed the slices before writing"
        assert [m for m, _ in api.writes[writes:]] == ["PUT"]
        assert devices_stored(api)["gpu-1"]["taints"] == TAINT
        assert pub.stats.errors == []
    finally:
        pub.stop()


def test_the_watch_reporting_the_publishers_own_write_costs_no_list(api: WatchedApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = started(api, desired)
    try:
        api.delivering.clear()
        desired[0] = spec(device("gpu-0", taints=TAINT))
        assert pub.wait_synced(pub.trigger(), WAIT)
        lists, writes = api.lists, len(api.writes)
        api.delivering.set()
        api.events.join()  # the watch reported the PUT back
        time.sleep(0.3)  # a reconcile it triggered would have run by now
        assert (api.lists, len(api.writes)) == (lists, writes)
    finally:
        pub.stop()


def test_a_slice_changed_by_someone_else_is_written_back_from_the_watch(
    api: WatchedApi,
) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = started(api, desired)
    try:
        api.events.put(("MODIFIED", copy.deepcopy(api.edit_behind_the_publisher(1))))
        deadline = time.monotonic() + WAIT
        while devices_stored(api)["gpu-1"]["attributes"]["index"] != {"int": 0}:
            assert time.monotonic() < deadline, "the edit was never reverted"
            time.sleep(0.01)
    finally:
        pub.stop()


def test_a_write_refused_for_a_stale_copy_lists_and_publishes_at_once(
    api: WatchedApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher, "RETRY_SECONDS", 2 * WAIT)  # a retry would miss the wait
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = started(api, desired)
    try:
        api.edit_behind_the_publisher(1)  # its watch event is late: the copy is stale
        desired[1] = spec(device("gpu-1", taints=TAINT))
        assert pub.wait_synced(pub.trigger(), WAIT), "waited for the retry backoff"
        stored = devices_stored(api)["gpu-1"]
        assert stored["taints"] == TAINT and stored["attributes"]["index"] == {"int": 0}
        assert pub.stats.errors == []
    finally:
        pub.stop()


def test_a_copy_missing_a_slice_lists_instead_of_creating_a_duplicate(api: WatchedApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = started(api, desired)
    try:
        first = api.slices[sorted(api.slices)[0]]
        pub._cache.replace([copy.deepcopy(first)])  # the watch has not seen the other yet
        desired[1] = spec(device("gpu-1", taints=TAINT))
        assert pub.wait_synced(pub.trigger(), WAIT)
        assert len(api.slices) == 2
        assert devices_stored(api)["gpu-1"]["taints"] == TAINT
        assert {s["spec"]["pool"]["generation"] for s in api.slices.values()} == {1}
    finally:
        pub.stop()


def test_a_burst_of_xids_during_a_write_costs_few_writes(api: WatchedApi) -> None:
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = started(api, desired)
    release = threading.Event()
    real_request = api.request

    def slow_puts(method: str, path: str, **kwargs: Any) -> Any:
        if method == "PUT":
            release.wait(WAIT)
        return real_request(method, path, **kwargs)

    api.request = slow_puts  # type: ignore[method-assign]
    try:
        writes = len(api.writes)
        desired[0] = spec(device("gpu-0", taints=TAINT))
        pub.trigger()
        time.sleep(0.1)  # the first write is in flight
        for n in range(1, 8):  # more Xids meanwhile, on both GPUs
            desired[n % 2] = spec(device(f"gpu-{n % 2}", taints=[{**TAINT[0], "value": str(n)}]))
            ticket = pub.trigger()
        release.set()
        assert pub.wait_synced(ticket, WAIT)
        assert len(api.writes) - writes <= 3  # the first write, then each slice once
        assert devices_stored(api)["gpu-1"]["taints"][0]["value"] == "7"
    finally:
        release.set()
        pub.stop()


class OneAnswer:
    """A `Connection` that answers every request with the same body."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def request(self, method: str, path: str, **_: Any) -> Any:
        class Response:
            status = 200
            reason = "OK"
            data = self.body

        return Response()


def test_answers_keep_duplicate_keys_detectable_unless_the_caller_opts_out() -> None:
    api = KubeApi(OneAnswer(b'{"a": 1, "a": 2}'))  # type: ignore[arg-type]
    strict = api.request("GET", "/apis/x")
    assert isinstance(strict, KeyTrackingDict) and strict.duplicates == ["a"]
    plain = api.request("GET", "/apis/x", strict=False)
    assert type(plain) is dict and plain == {"a": 2}


def _slice(version: str, index: int) -> dict[str, Any]:
    return {
        "metadata": {"name": "00000-slice", "resourceVersion": version},
        "spec": spec(device("gpu-0", attributes={"index": {"int": index}})),
    }


def test_the_answer_to_an_own_write_never_replaces_a_newer_version_from_the_watch() -> None:
    """The watch may report the own write (v6) and another instance's write after it
    (v7) before the answer to the own write (v6) arrives: v7 stays in the copy, so the
    reconcile v7 asked for sees the other content and writes back."""
    cache = SliceCache()
    cache.replace([_slice("5", 0)])
    assert cache.observed("MODIFIED", _slice("6", 0)) is True
    assert cache.observed("MODIFIED", _slice("7", 42)) is True
    cache.wrote(_slice("6", 0), based_on="5")
    (held,) = cache.items() or []
    assert held["metadata"]["resourceVersion"] == "7"
    assert held["spec"]["devices"][0]["attributes"]["index"] == {"int": 42}


def test_the_answer_to_an_own_write_is_kept_when_no_event_came_first() -> None:
    cache = SliceCache()
    cache.replace([_slice("5", 0)])
    cache.wrote(_slice("6", 1), based_on="5")
    cache.wrote({**_slice("9", 0), "metadata": {"name": "00001-new", "resourceVersion": "9"}}, None)
    held = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in cache.items() or []}
    assert held == {"00000-slice": "6", "00001-new": "9"}
