"""bench.allocator's input: the layout's slices on every node, as the driver publishes
them, and a claim the scheduler's allocator reads without the API server's defaults."""

from __future__ import annotations

from bench import scale_objects as obj
from bench.allocator import allocator_input, table


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
