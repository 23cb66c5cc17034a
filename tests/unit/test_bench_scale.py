"""The pure parts of the scheduler-scale benchmark: slices per layout, pod counts,
percentile and throughput math, the report table and the doc section it rewrites."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from bench import scale_layouts
from bench import scale_objects as obj
from bench import scale_report as report
from bench.scale import _int_list, _layout_list
from bench.scale import main as scale_main
from bench.scale_scheduler import UNTHROTTLED_SCHEDULER, parse_totals
from driver.devices.formatting import parse_quantity
from driver.devices.slices import (
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
    validate_slice_specs,
)


def _slices(layout: str, node: str = "scale-node-0000") -> list[dict[str, Any]]:
    return obj.node_slices(obj.LAYOUTS[layout], node, "uid-1")


@pytest.mark.parametrize(
    ("layout", "devices", "slices"),
    [
        # 8 GPUs x (whole + 25 MIG placements); 1 counter-set slice + 208 / 64 -> 4.
        ("mig", 8 * 26, 5),
        # 8 GPUs x (whole + seven 1g.10gb, two 3g.40gb, one 7g.80gb); 1 + 88 / 64 -> 2.
        ("mig3", 8 * 11, 3),
        ("whole", 8, 1),
        # 8 GPUs x (4 partitions + full); 1 counter-set slice + 1 device slice.
        ("partitions4", 8 * 5, 2),
        ("mig3-all-counters", 8 * 11, 3),
        ("mig3-gpu-slices", 8 * 11, 1 + 8),  # a device slice per GPU
        ("mig3-set-slices", 8 * 11, 8 + 2),  # a counter-set slice per GPU
        ("mig3-few-attributes", 8 * 11, 3),
        ("mig3-slice-counters", 8 * 11, 3),
        ("mig3-one-set", 8 * 11, 3),  # 1 counter-set slice + 2 device slices
        ("mig3-mig-first", 8 * 11, 3),
    ],
)
def test_each_layout_publishes_the_driver_slices_of_8_h100(
    layout: str, devices: int, slices: int
) -> None:
    docs = _slices(layout)
    assert len(docs) == slices
    assert obj.slice_device_count(docs) == devices
    assert validate_slice_specs([d["spec"] for d in docs]) == []
    for doc in docs:
        spec = doc["spec"]
        assert spec["nodeName"] == "scale-node-0000"
        assert spec["pool"] == {
            "name": "scale-node-0000",
            "generation": 1,
            "resourceSliceCount": slices,
        }
        assert doc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert len(spec.get("devices", [])) <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS


def _devices(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for doc in docs for d in doc["spec"].get("devices", [])}


@pytest.mark.parametrize("variant", obj.MIG3_VARIANTS)
def test_mig3_variants_publish_the_same_devices(variant: str) -> None:
    mig3, reshaped = _devices(_slices("mig3")), _devices(_slices(f"mig3-{variant}"))
    assert sorted(reshaped) == sorted(mig3)  # mig-first changes the order only
    assert all(d["capacity"] == mig3[name]["capacity"] for name, d in reshaped.items())
    # The chart's DeviceClasses and the claims' selector read `profile`.
    assert all(
        d["attributes"].get("profile") == mig3[name]["attributes"].get("profile")
        for name, d in reshaped.items()
    )


def test_mig3_counts_memory_blocks_and_all_counters_every_dimension() -> None:
    """`mig3-all-counters` adds the counters the driver drops because no disjoint
    placements can exceed them (values of the mock's H100)."""
    sets = [
        cs for doc in _slices("mig3-all-counters") for cs in doc["spec"].get("sharedCounters", [])
    ]
    blocks = {"memory-slices-0-3": {"value": "4"}, "memory-slices-4-7": {"value": "4"}}
    assert sets[0] == {
        "name": "gpu-0-counter-set",
        "counters": {
            "memory": {"value": "81152Mi"},
            "multiprocessors": {"value": "132"},
            "copy-engines": {"value": "8"},
            "decoders": {"value": "7"},
            "encoders": {"value": "0"},
            "jpeg-engines": {"value": "7"},
            "ofa-engines": {"value": "1"},
            **blocks,
        },
    }
    every, slim = _devices(_slices("mig3-all-counters")), _devices(_slices("mig3"))
    assert every["gpu-0-mig-1g10gb-0"]["consumesCounters"] == [
        {
            "counterSet": "gpu-0-counter-set",
            "counters": {
                "memory": {"value": "9984Mi"},
                "multiprocessors": {"value": "16"},
                "copy-engines": {"value": "1"},
                "decoders": {"value": "1"},
                "jpeg-engines": {"value": "1"},
                "memory-slices-0-3": {"value": "1"},
            },
        }
    ]
    assert slim["gpu-0-mig-1g10gb-0"]["consumesCounters"][0]["counters"] == {
        "memory-slices-0-3": {"value": "1"}
    }
    whole = every["gpu-0"]["consumesCounters"][0]["counters"]
    assert whole == {k: v for k, v in sets[0]["counters"].items() if k != "encoders"}
    assert slim["gpu-0"]["consumesCounters"][0]["counters"] == blocks


def test_few_attributes_keeps_what_selectors_read() -> None:
    devices = _devices(_slices("mig3-few-attributes"))
    assert set(devices["gpu-0-mig-1g10gb-0"]["attributes"]) == {"profile", "parentUUID"}
    assert set(devices["gpu-0"]["attributes"]) == {"parentUUID"}  # a whole GPU: no profile


def _mig3_specs() -> list[dict[str, Any]]:
    return [d["spec"] for d in _slices("mig3")]


def _admits(specs: list[dict[str, Any]]) -> Callable[[Iterable[str]], bool]:
    """The scheduler's counter rule over specs: what devices consume together fits."""
    available = {
        (cs["name"], k): parse_quantity(v["value"])
        for s in specs
        for cs in s.get("sharedCounters") or []
        for k, v in cs["counters"].items()
    }
    needs = {
        d["name"]: [
            ((c["counterSet"], k), parse_quantity(v["value"]))
            for c in d.get("consumesCounters") or []
            for k, v in c["counters"].items()
        ]
        for s in specs
        for d in s.get("devices") or []
    }

    def admits(names: Iterable[str]) -> bool:
        used: dict[tuple[str, str], Decimal] = {}
        for name in names:
            for key, amount in needs[name]:
                used[key] = used.get(key, Decimal(0)) + amount
        return all(amount <= available[key] for key, amount in used.items())

    return admits


@pytest.mark.parametrize("variant", scale_layouts.RESHAPES)
def test_every_slice_layout_admits_exactly_the_sets_mig3_admits(variant: str) -> None:
    """Every subset of two GPUs' devices (a GPU's 11 and pairs across them)."""
    mig3 = _mig3_specs()
    reshaped = scale_layouts.reshape(variant, mig3)
    before, after = _devices([{"spec": s} for s in mig3]), _devices([{"spec": s} for s in reshaped])
    assert sorted(after) == sorted(before)
    assert all(d["capacity"] == before[name]["capacity"] for name, d in after.items())
    old, new = _admits(mig3), _admits(reshaped)
    gpu0 = [n for n in before if n == "gpu-0" or n.startswith("gpu-0-")]
    for size in range(len(gpu0) + 1):
        for chosen in itertools.combinations(gpu0, size):
            assert new(chosen) == old(chosen), chosen
    gpu1 = [n for n in before if n == "gpu-1" or n.startswith("gpu-1-")]
    for pair in itertools.product(gpu0, gpu1):
        assert new(pair) and old(pair)


def test_slice_counters_count_each_memory_slice_a_device_sits_on() -> None:
    """The layout before blocks: one counter per slice, in the set and per device."""
    reshaped = scale_layouts.reshape("slice-counters", _mig3_specs())
    sets = [cs for s in reshaped for cs in s.get("sharedCounters") or []]
    assert sets[0]["counters"] == {f"memory-slice-{i}": {"value": "1"} for i in range(8)}
    devices = _devices([{"spec": s} for s in reshaped])

    def consumed(name: str) -> set[str]:
        return set(devices[name]["consumesCounters"][0]["counters"])

    assert consumed("gpu-0-mig-1g10gb-5") == {"memory-slice-5"}
    assert consumed("gpu-0-mig-3g40gb-4") == {f"memory-slice-{i}" for i in range(4, 8)}
    assert consumed("gpu-0") == {f"memory-slice-{i}" for i in range(8)}


def test_mig_first_puts_each_gpus_whole_device_after_its_partitions() -> None:
    names = list(_devices([{"spec": s} for s in scale_layouts.reshape("mig-first", _mig3_specs())]))
    assert names[9:12] == ["gpu-0-mig-7g80gb-0", "gpu-0", "gpu-1-mig-1g10gb-0"]


def test_an_unknown_reshape_is_named() -> None:
    with pytest.raises(scale_layouts.LayoutError, match="unknown slice layout 'x'"):
        scale_layouts.reshape("x", [d["spec"] for d in _slices("mig3")])


def test_mig_layout_has_every_1g10gb_placement_per_gpu() -> None:
    names = [d["name"] for doc in _slices("mig") for d in doc["spec"].get("devices", [])]
    assert [n for n in names if n.startswith("gpu-3-mig-1g10gb-") and "-me-" not in n] == [
        f"gpu-3-mig-1g10gb-{i}" for i in range(7)
    ]


def test_partition_layout_is_the_reference_layout() -> None:
    names = [d["name"] for doc in _slices("partitions4") for d in doc["spec"].get("devices", [])]
    assert names[:5] == [f"gpu-0-partition-{j}" for j in range(4)] + ["gpu-0-full"]


def test_slices_of_n_nodes_are_per_node_pools_with_distinct_uuids() -> None:
    layout = obj.LAYOUTS["whole"]
    fleet = layout.fleet()
    docs = [d for i in range(3) for d in obj.node_slices(layout, obj.node_name(i), f"u{i}", fleet)]
    assert [d["spec"]["pool"]["name"] for d in docs] == [obj.node_name(i) for i in range(3)]
    uuids = {dev["attributes"]["uuid"]["string"] for d in docs for dev in d["spec"]["devices"]}
    assert len(uuids) == 3 * obj.GPUS_PER_NODE


def test_claims_ask_each_layout_for_one_device_of_its_class() -> None:
    mig = obj.claim_document(obj.LAYOUTS["mig"], "c")["spec"]["devices"]["requests"]
    assert mig[0]["exactly"]["deviceClassName"] == obj.MIG_CLASS
    parts = obj.claim_document(obj.LAYOUTS["partitions4"], "c")["spec"]["devices"]["requests"]
    assert parts[0]["exactly"]["deviceClassName"] == obj.GPU_PARTITION_CLASS
    assert "1g.10gb" in mig[0]["exactly"]["selectors"][0]["cel"]["expression"]
    whole = obj.claim_document(obj.LAYOUTS["whole"], "c")["spec"]["devices"]["requests"]
    assert whole == [{"name": "gpu", "exactly": {"deviceClassName": obj.WHOLE_CLASS}}]
    pod = obj.pod_document("p", "c", UNTHROTTLED_SCHEDULER)["spec"]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "c"}]
    assert pod["schedulerName"] == UNTHROTTLED_SCHEDULER


def test_pod_count_is_half_the_whole_gpus_capped() -> None:
    assert obj.pod_count(10, 400) == 40
    assert obj.pod_count(100, 400) == 400
    assert obj.pod_count(500, 400) == 400
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        obj.pod_count(0, 400)
    with pytest.raises(ValueError, match="pod cap"):
        obj.pod_count(10, 0)


def test_percentile_interpolates_between_closest_ranks() -> None:
    samples = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert report.percentile(samples, 50) == 3.0
    assert report.percentile(samples, 0) == 1.0
    assert report.percentile(samples, 100) == 5.0
    assert report.percentile(samples, 99) == pytest.approx(4.96)
    assert report.percentile([7.0], 99) == 7.0
    with pytest.raises(report.ReportError, match="no samples"):
        report.percentile([], 50)
    with pytest.raises(report.ReportError, match=r"within 0\.\.100"):
        report.percentile(samples, 101)


def test_throughput_spans_first_creation_to_last_scheduling() -> None:
    assert report.throughput([0.0, 0.1, 0.2, 0.3], [0.5, 1.0, 1.5, 2.0]) == 2.0
    with pytest.raises(report.ReportError, match="one creation and one scheduling"):
        report.throughput([0.0], [1.0, 2.0])
    with pytest.raises(report.ReportError, match="non-positive span"):
        report.throughput([1.0], [1.0])


def _point(
    layout: str, nodes: int, latencies: list[list[float]], scheduler: str = "default"
) -> dict[str, Any]:
    return {
        "layout": layout,
        "nodes": nodes,
        "scheduler": scheduler,
        "slices": nodes,
        "devices": 8 * nodes,
        "slice_bytes": 3 << 20,
        "publish_s": 1.5,
        "repetitions": [
            {
                "latency_ms": lat,
                "pods_per_s": 10.0 * (i + 1),
                "unscheduled": 0,
                "scheduler": {"filter_count": 2, "filter_seconds": 0.01 * (i + 1)},
            }
            for i, lat in enumerate(latencies)
        ],
    }


def _results(points: list[dict[str, Any]]) -> dict[str, Any]:
    load = {"1m": 1.0, "5m": 2.0, "15m": 3.0}
    return {
        "started": "2026-01-01T00:00:00Z",
        "points": points,
        "load": {"start": load, "end": load},
    }


def test_summary_pools_repetitions() -> None:
    s = report.summarise(_point("mig", 10, [[100.0, 300.0], [200.0]]))
    assert s.pods == 3
    assert s.repetitions == 2
    assert s.p50_ms == 200.0
    assert s.max_ms == 300.0
    assert s.pods_per_s == (10.0, 20.0)
    assert s.slice_mib == 3.0
    assert s.filter_ms == pytest.approx(7.5)  # (0.01 + 0.02) s over 4 cycles
    assert s.dra_node_ms is None


def test_summary_names_a_missing_field() -> None:
    point = _point("mig", 10, [[1.0]])
    del point["repetitions"][0]["pods_per_s"]
    with pytest.raises(report.ReportError, match="'pods_per_s' is missing"):
        report.summarise(point)


def test_table_orders_by_scheduler_nodes_layout_and_compares_with_whole() -> None:
    results = _results(
        [
            _point("whole", 100, [[100.0]], "unthrottled"),
            _point("whole", 100, [[100.0]]),
            _point("mig", 100, [[250.0]]),
            _point("mig", 10, [[50.0]]),
            _point("mig", 100, [[150.0]], "unthrottled"),
        ]
    )
    rows = report.table(results).splitlines()[2:]
    assert [r.split("|")[1:4] for r in rows] == [
        [" default ", " mig ", " 10 "],
        [" default ", " mig ", " 100 "],
        [" default ", " whole ", " 100 "],
        [" unthrottled ", " mig ", " 100 "],
        [" unthrottled ", " whole ", " 100 "],
    ]
    assert "| 2.50x |" in rows[1]  # against the default scheduler's whole GPUs
    assert "| 1.50x |" in rows[3]  # against the unthrottled scheduler's
    assert "| 1.00x |" in rows[2]
    assert "| - |" in rows[0]  # no whole-GPU point at 10 nodes


def test_replace_section_rewrites_only_between_markers() -> None:
    doc = f"# T\n\nbefore\n{report.BEGIN}\nold\n{report.END}\nafter\n"
    new = report.replace_section(doc, _results([_point("whole", 10, [[1.0, 2.0]])]))
    assert new.startswith("# T\n\nbefore\n<!-- scale:begin -->\nRun 2026-01-01T00:00:00Z")
    assert new.endswith("<!-- scale:end -->\nafter\n")
    assert "old" not in new
    assert "| default | whole | 10 |" in new
    with pytest.raises(report.ReportError, match="markers"):
        report.replace_section("no markers", _results([]))


def test_a_named_section_is_rewritten_and_the_main_one_kept() -> None:
    begin, end = report.markers("profiles")
    assert (begin, end) == ("<!-- scale:profiles:begin -->", "<!-- scale:profiles:end -->")
    doc = f"{report.BEGIN}\nmain\n{report.END}\n{begin}\nold\n{end}\n"
    new = report.replace_section(doc, _results([_point("whole", 10, [[1.0, 2.0]])]), "profiles")
    assert new.startswith(
        f"{report.BEGIN}\nmain\n{report.END}\n<!-- scale:profiles:begin -->\nRun "
    )
    assert "old" not in new and new.endswith("<!-- scale:profiles:end -->\n")


def test_report_prints_a_named_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "scale.json"
    results.write_text(json.dumps(_results([_point("mig3", 10, [[1.0]])])))
    assert scale_main(["--report", str(results), "--section", "layouts"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("<!-- scale:layouts:begin -->\nRun 2026-01-01T00:00:00Z")
    assert out.endswith("<!-- scale:layouts:end -->\n")


def test_scheduler_histograms_are_summed_over_their_series() -> None:
    text = "\n".join(
        [
            "# HELP x",
            'scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",'
            'profile="default-scheduler",status="Success"} 0.5',
            'scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",'
            'profile="default-scheduler",status="Success"} 4',
            'scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",'
            'profile="default-scheduler",status="Unschedulable"} 1',
            'scheduler_framework_extension_point_duration_seconds_bucket{extension_point="Filter",'
            'profile="default-scheduler",status="Success",le="0.1"} 3',
            'scheduler_framework_extension_point_duration_seconds_sum{extension_point="Bind",'
            'profile="default-scheduler",status="Success"} 9',
            'scheduler_plugin_execution_duration_seconds_sum{extension_point="Filter",'
            'plugin="DynamicResources",status="Success"} 0.25',
        ]
    )
    totals = parse_totals(text)
    assert totals["filter_count"] == 5
    assert totals["filter_seconds"] == 0.5
    assert totals["dra_filter_node_seconds"] == 0.25
    assert totals["attempt_count"] == 0


def test_cli_lists_are_checked() -> None:
    assert _int_list("10,100") == [10, 100]
    with pytest.raises(argparse.ArgumentTypeError, match="--nodes"):
        _int_list("10,x")
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        _int_list("0")
    assert _layout_list("mig,whole") == ["mig", "whole"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown gpus"):
        _layout_list("mig,gpus")
