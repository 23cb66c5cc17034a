"""bench.allocator's input: the layout's slices on every node, as the driver publishes
them, and a claim the scheduler's allocator reads without the API server's defaults."""

from __future__ import annotations

import pytest

from bench import scale_layouts
from bench import scale_objects as obj
from bench.allocator import allocator_input, layouts, main, table


def test_the_input_holds_every_node_s_slices_and_a_claim_for_one_device() -> None:
    layout = obj.LAYOUTS["mig3"]
    data = allocator_input(layout, 3)
    assert data["nodes"] == [obj.node_name(i) for i in range(3)]
    per_node = obj.node_slices(layout, obj.node_name(0), "uid-0")
    assert len(data["slices"]) == 3 * len(per_node)
    assert {s["spec"]["nodeName"] for s in data["slices"]} == set(data["nodes"])
    (request,) = data["claim"]["spec"]["devices"]["requests"]
    assert request["exactly"]["allocationMode"] == "ExactCount"
    assert request["exactly"]["count"] == 1
    assert request["exactly"]["deviceClassName"] in {c["metadata"]["name"] for c in data["classes"]}


def test_the_table_has_a_row_per_layout() -> None:
    rows = [
        {
            "layout": name,
            "devicesPerNode": 8,
            "slicesPerNode": 1,
            "microsPerNode": 17.6,
            "kibPerNode": 12.0,
            "mallocsPerNode": 122,
            "device": "gpu-0",
        }
        for name in ("whole", "mig3")
    ]
    lines = table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| whole | 8 | 1 | 18 |")


def test_every_slice_layout_is_a_mig3_variant_of_the_allocator() -> None:
    known = layouts()
    for variant in scale_layouts.RESHAPES:
        layout = known[f"mig3-{variant}"]
        assert layout.reshape == variant
        assert layout.mig_profiles == obj.LAYOUTS["mig3"].mig_profiles
    assert known["whole"] == obj.LAYOUTS["whole"]


def _request(data: dict[str, object]) -> dict[str, object]:
    (request,) = data["claim"]["spec"]["devices"]["requests"]  # type: ignore[index]
    exactly: dict[str, object] = request["exactly"]
    return exactly


def test_the_claim_can_ask_mig_layouts_for_another_profile_or_any_for_a_whole_gpu() -> None:
    mig3, whole = obj.LAYOUTS["mig3"], obj.LAYOUTS["whole"]
    larger = _request(allocator_input(mig3, 1, "3g.40gb"))
    assert larger["deviceClassName"] == obj.MIG_CLASS
    assert larger["selectors"] == [
        {"cel": {"expression": "device.attributes['gpu.example.com'].profile == '3g.40gb'"}}
    ]
    gpu = _request(allocator_input(mig3, 1, "whole"))
    assert gpu["deviceClassName"] == obj.WHOLE_CLASS and "selectors" not in gpu
    # A layout without MIG devices keeps its own claim for a profile.
    assert _request(allocator_input(whole, 1, "3g.40gb")) == _request(allocator_input(whole, 1))


def test_a_claim_that_is_no_profile_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--claim", "3g40gb"])
    assert "--claim: '3g40gb' is neither whole nor a MIG profile" in capsys.readouterr().err
