"""demo/ offline: what `make demo` and the e2e tier rely on in the examples' YAML, and
that the sharing examples' story (two shares fit on one device, a third does not) holds
for the fleet of demo/values-demo.yaml. The e2e tier runs them on a real node."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli.validate.cel_device import Selector, device_activation
from driver.devices.formatting import parse_quantity
from driver.devices.model import PoolOptions, build_pool
from driver.nvml.selection import select_backend
from tests.unit.test_chart_device_classes import cel_selects, class_selectors
from tests.unit.test_chart_render import render

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "demo"
NUMBERED = sorted(DEMO.glob("[0-9]*.yaml"))
PARTITION_EXAMPLE = DEMO / "partitions" / "shared-partition-capacity.yaml"
MPS_EXAMPLE = DEMO / "mps" / "cooperative-shares.yaml"
STRICT_PARTITIONS_EXAMPLE = DEMO / "mps" / "strict-partitions.yaml"
EXAMPLES = [*NUMBERED, PARTITION_EXAMPLE, MPS_EXAMPLE, STRICT_PARTITIONS_EXAMPLE]
CLUSTER_SCOPED = {"Namespace", "DeviceClass", "DeviceTaintRule"}
DEMO_LABEL = ("app", "gpu-demo")  # demo.sh and the e2e tests select pods and rules by it

Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def name(path: Path) -> str:
    return str(path.relative_to(DEMO))


@pytest.mark.parametrize("path", EXAMPLES, ids=name)
def test_example_lives_in_its_own_namespace(path: Path) -> None:
    docs = documents(path)
    namespaces = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    assert len(namespaces) == 1, namespaces
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == namespaces[0], doc["metadata"]


def test_examples_have_distinct_namespaces() -> None:
    namespaces = [
        d["metadata"]["name"] for p in EXAMPLES for d in documents(p) if d["kind"] == "Namespace"
    ]
    assert len(set(namespaces)) == len(namespaces), namespaces


@pytest.mark.parametrize("path", EXAMPLES, ids=name)
def test_pods_and_cluster_scoped_objects_carry_the_demo_label(path: Path) -> None:
    """Deleting an example's namespace leaves its cluster-scoped objects (a DeviceTaintRule
    keeps a GPU tainted for everyone): demo.sh deletes them by the demo label."""
    key, value = DEMO_LABEL
    for doc in documents(path):
        if doc["kind"] == "Pod" or doc["kind"] in CLUSTER_SCOPED - {"Namespace"}:
            labels = doc["metadata"].get("labels") or {}
            assert labels.get(key) == value, f"{doc['kind']}/{doc['metadata']['name']}"


def test_every_example_is_described_in_the_demo_readme() -> None:
    readme = (DEMO / "README.md").read_text()
    missing = [name(p) for p in EXAMPLES if f"]({name(p)})" not in readme]
    assert not missing, missing


# --- consumable capacity against the demo fleet ----------------------------------------


def demo_devices(gpu_partitions: int, tmp_path: Path, mps: bool = False) -> list[Doc]:
    """The device documents the plugin publishes with values-demo.yaml (+ partitions, +
    MPS daemons)."""
    values = yaml.safe_load((DEMO / "values-demo.yaml").read_text())
    assert values["kubeletPlugin"]["allowMultipleAllocations"] is True
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(values["nvml"]["mockFleet"])
    inventory = select_backend(mock=True, fleet_path=fleet, node_name="demo").discover()
    options = PoolOptions(allow_multiple_allocations=True, gpu_partitions=gpu_partitions, mps=mps)
    return [d.document for d in build_pool(inventory, options).devices]


def share_requests(path: Path) -> Iterator[tuple[str, dict[str, Decimal]]]:
    """(device class, capacity.requests) of each template request asking for a share."""
    for doc in documents(path):
        if doc["kind"] != "ResourceClaimTemplate":
            continue
        for request in doc["spec"]["spec"]["devices"]["requests"]:
            exactly = request["exactly"]
            wanted = (exactly.get("capacity") or {}).get("requests")
            if wanted:
                yield exactly["deviceClassName"], {k: parse_quantity(v) for k, v in wanted.items()}


def first_shareable(devices: list[Doc], partitions: bool) -> Doc:
    """The first shareable device of the class in publishing order: the scheduler's
    first choice for the first share."""
    for device in devices:
        is_partition = "partition" in device["attributes"]
        if device.get("allowMultipleAllocations") and is_partition == partitions:
            return device
    raise AssertionError(f"no shareable {'partition' if partitions else 'GPU'} in the fleet")


def request_selectors(path: Path) -> list[str]:
    """The CEL selectors of the example's (one) template request: its DeviceClass's, as
    the chart renders it with demo/values-demo.yaml, and its own."""
    (exactly,) = (
        request["exactly"]
        for doc in documents(path)
        if doc["kind"] == "ResourceClaimTemplate"
        for request in doc["spec"]["spec"]["devices"]["requests"]
    )
    classes = class_selectors(render("--values", str(DEMO / "values-demo.yaml")))
    assert exactly["deviceClassName"] in classes, exactly["deviceClassName"]
    own = [s["cel"]["expression"] for s in exactly.get("selectors", [])]
    return [classes[exactly["deviceClassName"]], *own]


def shareable(device: Doc) -> dict[str, Decimal]:
    return {
        key: parse_quantity(entry["requestPolicy"]["validRange"]["max"])
        for key, entry in device["capacity"].items()
    }


def fits(shares: list[dict[str, Decimal]], limit: dict[str, Decimal]) -> bool:
    return all(sum(s[key] for s in shares) <= limit[key] for key in limit)


@pytest.mark.parametrize(
    ("path", "partitions"),
    [(DEMO / "11-shared-gpu-capacity.yaml", False), (PARTITION_EXAMPLE, True)],
    ids=["gpu", "partition"],
)
def test_two_shares_fit_on_one_device_and_a_third_does_not(
    path: Path, partitions: bool, tmp_path: Path
) -> None:
    ((_, wanted),) = share_requests(path)
    values = yaml.safe_load((DEMO / "partitions" / "values.yaml").read_text())
    devices = demo_devices(values["kubeletPlugin"]["gpuPartitions"] if partitions else 0, tmp_path)
    first = first_shareable(devices, partitions)
    # The request's class and selectors pick exactly the shareable devices of its kind
    # (whole GPUs, or the time-shared --gpu-partitions partitions).
    selectors = request_selectors(path)
    picked = [d for d in devices if all(cel_selects(e, d) for e in selectors)]
    assert picked and picked[0] == first
    assert all(("partition" in d["attributes"]) == partitions for d in picked)
    limit = shareable(first)
    assert fits([wanted, wanted], limit), (wanted, limit)
    assert not fits([wanted, wanted, wanted], limit), (wanted, limit)


def test_init_container_share_fits_beside_the_two_shared_pods(tmp_path: Path) -> None:
    """13's share may land on the GPU 11's two pods share; it must not push one off."""
    ((_, pod_share),) = share_requests(DEMO / "11-shared-gpu-capacity.yaml")
    ((_, init_share),) = share_requests(DEMO / "13-init-container-shared-claim.yaml")
    limit = shareable(first_shareable(demo_devices(0, tmp_path), partitions=False))
    assert fits([pod_share, pod_share, init_share], limit), (pod_share, init_share, limit)


def test_the_time_sliced_share_leaves_room_for_the_other_shares(tmp_path: Path) -> None:
    """05's ts-gpu is a share (a GPU in MIG mode cannot take its interval), on the same
    two A100 40GB that 10-device-taints leaves to 11's three pods and 13's init share:
    whatever order the scheduler places them in, first fit puts every share."""
    shares = [s for _, s in share_requests(DEMO / "05-opaque-config.yaml")]
    shares += [s for _, s in share_requests(DEMO / "11-shared-gpu-capacity.yaml")] * 3
    shares += [s for _, s in share_requests(DEMO / "13-init-container-shared-claim.yaml")]
    assert len(shares) == 5
    limit = shareable(first_shareable(demo_devices(0, tmp_path), partitions=False))
    for order in itertools.permutations(shares):
        gpus: list[list[dict[str, Decimal]]] = [[], []]
        for share in order:
            gpu = next((g for g in gpus if fits([*g, share], limit)), None)
            assert gpu is not None, (order, limit)
            gpu.append(share)


def test_the_mps_example_selects_the_devices_that_say_mps_isolation_cooperative(
    tmp_path: Path,
) -> None:
    """demo/mps/cooperative-shares.yaml, with demo/mps/values.yaml (MPS daemons on):
    its requests' selectors, evaluated as DRA's CEL (gpu-dra validate's evaluator),
    pick the shareable GPUs that publish `mpsIsolation: "cooperative"`; without MPS
    daemons none, so the example never lands where nothing limits it. Both shares fit
    on one GPU."""
    values = yaml.safe_load((DEMO / "mps" / "values.yaml").read_text())
    assert values["kubeletPlugin"]["mps"]["enabled"] is True
    assert "mpsIsolation" in MPS_EXAMPLE.read_text() and ".mps)" not in MPS_EXAMPLE.read_text()
    classes = class_selectors(render("--values", str(DEMO / "values-demo.yaml")))
    templates = [d for d in documents(MPS_EXAMPLE) if d["kind"] == "ResourceClaimTemplate"]
    assert len(templates) == 2
    with_mps, without = demo_devices(0, tmp_path, mps=True), demo_devices(0, tmp_path)
    for template in templates:
        (exactly,) = (r["exactly"] for r in template["spec"]["spec"]["devices"]["requests"])
        selectors = [
            Selector(classes[exactly["deviceClassName"]]),
            *(Selector(s["cel"]["expression"]) for s in exactly["selectors"]),
        ]

        def picks(device: Doc, selectors: list[Selector] = selectors) -> bool:
            activation = device_activation(device, "gpu.example.com")
            return all(s.matches(activation) for s in selectors)

        picked = [d for d in with_mps if picks(d)]
        assert picked, template["metadata"]["name"]
        assert all(
            d.get("allowMultipleAllocations")
            and d["attributes"]["mpsIsolation"] == {"string": "cooperative"}
            for d in picked
        )
        assert not [d for d in without if picks(d)], template["metadata"]["name"]
    shares = [s for _, s in share_requests(MPS_EXAMPLE)]
    first = first_shareable(with_mps, partitions=False)
    assert fits(shares, shareable(first)), (shares, shareable(first))


def test_the_strict_partitions_example_gets_the_two_partitions_of_one_gpu(
    tmp_path: Path,
) -> None:
    """demo/mps/strict-partitions.yaml, with demo/mps/values-strict-partitions.yaml: its
    request (class and selector, as DRA's CEL) picks only partitions that publish
    `mpsIsolation: "strict"` (the A100 40GB, MIG off), and the first two in publishing
    order, what the scheduler gives its two pods, are the two partitions of one GPU:
    one server serves both. Without --mps-strict-partitions it picks nothing."""
    values = yaml.safe_load((DEMO / "mps" / "values-strict-partitions.yaml").read_text())
    plugin = values["kubeletPlugin"]
    assert plugin["mps"] == {"enabled": True, "strictPartitions": True}
    assert plugin["allowMultipleAllocations"] is False
    classes = class_selectors(render("--values", str(DEMO / "values-demo.yaml")))
    (template,) = [
        d for d in documents(STRICT_PARTITIONS_EXAMPLE) if d["kind"] == "ResourceClaimTemplate"
    ]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    selectors = [
        Selector(classes[request["exactly"]["deviceClassName"]]),
        *(Selector(s["cel"]["expression"]) for s in request["exactly"]["selectors"]),
    ]
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_load((DEMO / "values-demo.yaml").read_text())["nvml"]["mockFleet"])
    inventory = select_backend(mock=True, fleet_path=fleet, node_name="demo").discover()

    def picked(strict: bool) -> list[Doc]:
        options = PoolOptions(
            gpu_partitions=plugin["gpuPartitions"], mps=True, mps_strict_partitions=strict
        )
        return [
            d.document
            for d in build_pool(inventory, options).devices
            if all(s.matches(device_activation(d.document, "gpu.example.com")) for s in selectors)
        ]

    devices = picked(True)
    assert devices and all(
        "partition" in d["attributes"]
        and d["attributes"]["productName"] == {"string": "NVIDIA A100-SXM4-40GB"}
        for d in devices
    ), [d["name"] for d in devices]
    first, second = devices[:2]
    assert first["attributes"]["uuid"] == second["attributes"]["uuid"]
    assert picked(False) == []
