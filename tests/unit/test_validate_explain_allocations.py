"""`gpu-dra validate --explain` counts the cluster's allocations: ResourceClaims given
with the slices (`--slices`) take whole devices, shares of a device's capacity
(`consumedCapacity`) and the counters their devices consume; the explained claim's
own allocation is not counted against it. Without ResourceClaims the output says the
allocations were not counted. The output is a summary per request and selector; the
per-device lines come with `--devices`."""

from __future__ import annotations

import json
import re
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from driver.cli.validate.capacity import PolicyViolation, request_consumption
from driver.cli.validate.explain_summary import names_read
from driver.devices.model import PoolOptions, build_pool
from driver.devices.slices import build_slice_documents
from driver.nvml.selection import select_backend
from tests.unit.test_validate_cli import run_cli

DRIVER = "gpu.example.com"
Doc = dict[str, Any]


def _slices(tmp_path: Path, gpus: list[Doc], **options: Any) -> Path:
    """The ResourceSlices of a mock node `node-a` with `gpus` (fleet file groups), as
    `gpu-dra inventory -o json` prints them."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"gpus": gpus}))
    inventory = select_backend(mock=True, fleet_path=str(fleet), node_name="node-a").discover()
    docs = build_slice_documents(
        build_pool(inventory, PoolOptions(**options)), driver=DRIVER, node_name="node-a"
    )
    path = tmp_path / "slices.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return path


def shared_gpus(tmp_path: Path, count: int = 2) -> Path:
    """`count` A100-40GB with MIG off, published with allowMultipleAllocations: gpu-0,
    gpu-1, ... each with capacity memory 40Gi and compute 100 (request policies: min 1Gi
    / 1, step 1Gi / 1, default the whole)."""
    group = {"model": "A100-40GB", "count": count, "migMode": "disabled"}
    return _slices(tmp_path, [group], allow_multiple_allocations=True)


def mig_gpu(tmp_path: Path) -> Path:
    """One H100 in MIG mode: the whole GPU gpu-0 and its MIG placements, which consume
    the counters of gpu-0-counter-set (none shared by capacity)."""
    return _slices(tmp_path, [{"model": "H100-80GB", "count": 1}])


def claim(
    name: str = "pending",
    device_class: str = DRIVER,
    selectors: tuple[str, ...] = (),
    uid: str | None = None,
    **exactly: Any,
) -> Doc:
    request: Doc = {"deviceClassName": device_class, **exactly}
    if selectors:
        request["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    metadata: Doc = {"name": name, "namespace": "default"}
    if uid is not None:
        metadata["uid"] = uid
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
    }


def allocated(name: str, *results: Doc, uid: str | None = None) -> Doc:
    """A ResourceClaim as `kubectl get resourceclaims -o yaml` shows it once allocated."""
    doc = claim(name, uid=uid or str(uuid.uuid4()))
    doc["status"] = {"allocation": {"devices": {"results": list(results)}}}
    return doc


def share(device: str, memory: str, compute: str = "10") -> Doc:
    """An allocation result for a share of a device with allowMultipleAllocations."""
    return {
        "request": "gpu",
        "driver": DRIVER,
        "pool": "node-a",
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"memory": memory, "compute": compute},
    }


def whole(device: str, **extra: Any) -> Doc:
    """An allocation result for a whole device (no shareID)."""
    return {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device, **extra}


def write(tmp_path: Path, name: str, *docs: Doc) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def explain(
    tmp_path: Path, pending: Doc, slices: Path, *claims: Doc, devices: bool = True
) -> tuple[int, str, str]:
    argv = ["--explain", write(tmp_path, "claim.yaml", pending), "--slices", str(slices)]
    if claims:
        argv += ["--slices", write(tmp_path, "claims.yaml", *claims)]
    if devices:
        argv.append("--devices")
    return run_cli(*argv)


def device_line(out: str, device: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(f"  {device} on node-a: "))


# --- capacity taken by other claims --------------------------------------------------


def test_a_device_whose_capacity_other_claims_consumed_no_longer_matches(tmp_path: Path) -> None:
    """The operator's case: gpu-0 is shared 16Gi + 16Gi + 8Gi of 40Gi, gpu-1 is
    allocated whole: a claim for 16Gi cannot be allocated, and the output says why."""
    others = [
        allocated("a", share("gpu-0", "16Gi")),
        allocated("b", share("gpu-0", "16Gi")),
        allocated("c", share("gpu-0", "8Gi")),
        allocated("e", whole("gpu-1")),
    ]
    pending = claim(capacity={"requests": {"memory": "16Gi", "compute": "10"}})
    code, out, err = explain(tmp_path, pending, shared_gpus(tmp_path), *others)
    assert code == 1, out
    assert "1 request(s) cannot be allocated" in err
    assert "0 of 2 device(s) match, 1 needed: CANNOT ALLOCATE" in out
    assert device_line(out, "gpu-0") == (
        "  gpu-0 on node-a: excluded by allocations: capacity memory: 40Gi, "
        "40Gi allocated to 3 claim(s), 16Gi requested"
    )
    assert device_line(out, "gpu-1") == (
        "  gpu-1 on node-a: excluded by allocations: allocated whole to default/e"
    )
    assert "allocations: 4 ResourceClaim(s) given, 4 allocated" in out


def test_remaining_capacity_is_enough_until_the_request_exceeds_it(tmp_path: Path) -> None:
    others = [
        allocated("a", share("gpu-0", "16Gi"), share("gpu-0", "8Gi")),
        allocated("e", whole("gpu-1")),
        allocated("admin", whole("gpu-0", adminAccess=True)),  # takes nothing
    ]
    slices = shared_gpus(tmp_path)
    fits = claim(capacity={"requests": {"memory": "16Gi", "compute": "10"}})
    code, out, err = explain(tmp_path, fits, slices, *others)
    assert code == 0, out + err
    assert "  gpu-0 on node-a: matches" in out
    # 16.5Gi is rounded up to the policy's step (1Gi): 17Gi, 1Gi more than is left.
    over = claim(capacity={"requests": {"memory": "16.5Gi", "compute": "10"}})
    code, out, _ = explain(tmp_path, over, slices, *others)
    assert code == 1, out
    assert device_line(out, "gpu-0").endswith(
        "capacity memory: 40Gi, 24Gi allocated to 1 claim(s), 17Gi requested "
        "(16.5Gi rounded up by the requestPolicy)"
    )


def test_a_capacity_the_request_does_not_name_consumes_the_policy_default(
    tmp_path: Path,
) -> None:
    """The scheduler charges a request that names no compute the requestPolicy's
    default, here the whole compute (100): a device with any compute allocated no
    longer fits it."""
    others = [allocated("a", share("gpu-0", "8Gi", compute="10"))]
    pending = claim(capacity={"requests": {"memory": "8Gi"}})
    code, out, err = explain(tmp_path, pending, shared_gpus(tmp_path), *others)
    assert code == 0, out + err  # gpu-1 is free
    assert device_line(out, "gpu-0").endswith(
        "capacity compute: 100, 10 allocated to 1 claim(s), 100 requested "
        "(the requestPolicy default: the request names no compute)"
    )
    assert "1 of 2 device(s) match, 1 needed: enough" in out


def test_the_explained_claim_does_not_count_against_itself(tmp_path: Path) -> None:
    """`kubectl get resourceclaims -A -o yaml` lists the explained claim too: its own
    allocation (matched by UID, else by namespace and name) is left out."""
    mine = "7d3c1c52-0f3a-4a8e-9b44-4f1f3c0e2a11"
    others = [
        allocated("pending", share("gpu-0", "16Gi"), uid=mine),
        allocated("a", share("gpu-0", "16Gi")),
        allocated("b", share("gpu-0", "8Gi")),
        allocated("e", whole("gpu-1")),
    ]
    slices = shared_gpus(tmp_path)
    asked = {"requests": {"memory": "16Gi", "compute": "10"}}
    for pending in (claim(uid=mine, capacity=asked), claim(capacity=asked)):
        code, out, err = explain(tmp_path, pending, slices, *others)
        assert code == 0, out + err
        assert "  gpu-0 on node-a: matches" in out
        assert "its own allocation (1 device(s)) is not counted" in out
    # Another claim of the same name (another UID) is another claim.
    code, out, _ = explain(tmp_path, claim(uid=str(uuid.uuid4()), capacity=asked), slices, *others)
    assert code == 1, out
    assert "40Gi allocated to 3 claim(s)" in device_line(out, "gpu-0")


# --- whole devices and counters --------------------------------------------------------


def test_allocated_devices_and_the_counters_they_consume_are_taken(tmp_path: Path) -> None:
    slices = mig_gpu(tmp_path)
    right = 'device.attributes["gpu.example.com"].profile == "1g.10gb"'
    pending = claim(device_class=f"mig.{DRIVER}", selectors=(right,))
    # One 1g.10gb placement allocated: the others are left.
    taken = allocated("one", whole("gpu-0-mig-1g10gb-0"))
    code, out, err = explain(tmp_path, pending, slices, taken)
    assert code == 0, out + err
    assert device_line(out, "gpu-0-mig-1g10gb-0").endswith(
        "excluded by allocations: allocated whole to default/one"
    )
    assert device_line(out, "gpu-0-mig-1g10gb-1").endswith(": matches")
    # The whole GPU allocated consumes every memory slice of its counter set.
    code, out, _ = explain(tmp_path, pending, slices, allocated("big", whole("gpu-0")))
    assert code == 1, out
    assert "CANNOT ALLOCATE" in out
    line = device_line(out, "gpu-0-mig-1g10gb-1")
    assert re.search(
        r"excluded by allocations: counter gpu-0-counter-set/\S+: \d+, \d+ consumed by "
        r"gpu-0 \(default/big\), \d+ needed$",
        line,
    ), line


# --- without ResourceClaims ----------------------------------------------------------


def test_without_resource_claims_the_output_says_allocations_are_not_counted(
    tmp_path: Path,
) -> None:
    slices = shared_gpus(tmp_path)
    pending = claim(capacity={"requests": {"memory": "16Gi"}})
    code, out, _ = explain(tmp_path, pending, slices, devices=False)
    assert code == 0
    assert (
        "allocations not counted: no ResourceClaims given (add them with the slices: "
        "kubectl get resourceslices,resourceclaims -A -o yaml)"
    ) in out.splitlines()
    code, out, _ = explain(tmp_path, pending, slices, claim("idle"), devices=False)
    assert code == 0
    assert "allocations not counted" not in out
    assert "allocations: 1 ResourceClaim(s) given, 0 allocated" in out


# --- the summary -----------------------------------------------------------------------


def test_the_summary_counts_exclusions_per_selector_with_the_values_read(
    tmp_path: Path,
) -> None:
    slices = mig_gpu(tmp_path)
    typo = 'device.attributes["gpu.example.com"].profile == "1g.10gbb"'
    pending = claim(device_class=f"mig.{DRIVER}", selectors=(typo,))
    items = json.loads(slices.read_text())["items"]
    published = sum(len(item["spec"].get("devices") or []) for item in items)
    code, out, _ = explain(tmp_path, pending, slices, devices=False)
    assert code == 1
    lines = out.splitlines()
    assert not [x for x in lines if " on node-a: " in x], out  # no line per device
    assert len(lines) <= 10, out
    by_class = next(x for x in lines if "class mig.gpu.example.com selector[0]" in x)
    assert by_class.endswith(f": excluded 1 of {published} device(s): 1 false"), by_class
    own = next(x for x in lines if "exactly.selectors[0]" in x)
    assert own.endswith(
        f"excluded {published - 1} of {published - 1} device(s): {published - 1} false"
    ), own
    values = lines[lines.index(own) + 1]
    assert values.startswith("    profile of the excluded: 1g.10gb ("), values
    assert "+me" in values or "more" in values
    whole_gpu = lines[lines.index(by_class) + 1]
    assert whole_gpu == "    profile of the excluded: absent (1)", whole_gpu
    assert "per device: add --devices" in out
    code, detailed, _ = explain(tmp_path, pending, slices)
    assert len([x for x in detailed.splitlines() if " on node-a: excluded by" in x]) == published


def test_the_summary_names_the_product_names_a_selector_excluded(tmp_path: Path) -> None:
    h100 = 'device.attributes["gpu.example.com"].productName == "NVIDIA H100 80GB HBM3"'
    pending = claim(selectors=(h100,))
    code, out, _ = explain(tmp_path, pending, shared_gpus(tmp_path), devices=False)
    assert code == 1
    assert "    productName of the excluded: NVIDIA A100-SXM4-40GB (2)" in out.splitlines()


def test_the_summary_counts_what_allocations_exclude_with_examples(tmp_path: Path) -> None:
    others = [
        allocated("a", share("gpu-0", "32Gi")),
        allocated("b", share("gpu-1", "32Gi")),
        allocated("e", whole("gpu-2")),
    ]
    pending = claim(capacity={"requests": {"memory": "16Gi", "compute": "10"}})
    slices = shared_gpus(tmp_path, count=4)
    code, out, _ = explain(tmp_path, pending, slices, *others, devices=False)
    assert code == 0, out  # gpu-3 is free
    lines = out.splitlines()
    line = next(x for x in lines if x.startswith("  allocations: "))
    assert line == (
        "  allocations: excluded 3 of 4 device(s): 2 without enough capacity left, "
        "1 allocated whole"
    ), line
    assert (
        "    gpu-0 on node-a: capacity memory: 40Gi, 32Gi allocated to 1 claim(s), 16Gi requested"
    ) in lines


def test_devices_flag_needs_explain(tmp_path: Path) -> None:
    path = write(tmp_path, "claim.yaml", claim())
    code, _, err = run_cli(path, "--devices")
    assert code == 2
    assert "--devices needs --explain" in err


def test_the_summary_does_not_grow_with_the_number_of_nodes(tmp_path: Path) -> None:
    one = mig_gpu(tmp_path)
    items = json.loads(one.read_text())["items"]
    many = []
    for node in ("node-a", "node-b", "node-c", "node-d"):
        for item in json.loads(json.dumps(items)):
            item["spec"]["nodeName"] = item["spec"]["pool"]["name"] = node
            many.append(item)
    fleet = tmp_path / "fleet-slices.json"
    fleet.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": many}))
    typo = 'device.attributes["gpu.example.com"].profile == "1g.10gbb"'
    pending = claim(device_class=f"mig.{DRIVER}", selectors=(typo,))
    _, small, _ = explain(tmp_path, pending, one, devices=False)
    _, large, _ = explain(tmp_path, pending, fleet, devices=False)
    assert len(large.splitlines()) == len(small.splitlines()), large
    assert f"0 of {4 * len(items[-1]['spec']['devices'])} device(s) match" in large


def test_request_policies_round_up_or_refuse() -> None:
    capacity = {
        "memory": {
            "value": "40Gi",
            "requestPolicy": {"default": "8Gi", "validValues": ["8Gi", "20Gi", "40Gi"]},
        },
        "compute": {"value": "100"},
    }
    gib = Decimal(1 << 30)
    taken = request_consumption(capacity, {"memory": 10 * gib}, {"memory": "10Gi"})
    assert taken["memory"].amount == 20 * gib
    assert taken["memory"].why == "(10Gi rounded up by the requestPolicy)"
    assert taken["compute"].amount == 100 and not taken["compute"].named  # no policy: all
    assert request_consumption(capacity, {}, {})["memory"].amount == 8 * gib  # the default
    try:
        request_consumption(capacity, {"memory": 41 * gib}, {"memory": "41Gi"})
    except PolicyViolation as err:
        assert "above every valid value" in str(err)
    else:
        raise AssertionError("41Gi fits no valid value")


def test_the_names_a_selector_reads() -> None:
    expression = (
        "device.capacity['gpu.example.com'].memory.compareTo(quantity('10Gi')) >= 0 && "
        "'profile' in device.attributes['gpu.example.com'] && "
        "device.attributes['resource.kubernetes.io']['pciBusID'] != '' && "
        'device.attributes["gpu.example.com"].driverVersion.major() > 500 && '
        "device.attributes['gpu.example.com'].exists(k, true)"
    )
    assert names_read(expression, DRIVER) == [
        ("capacity", "memory"),
        ("attributes", "profile"),
        ("attributes", "resource.kubernetes.io/pciBusID"),
        ("attributes", "driverVersion"),
    ]
