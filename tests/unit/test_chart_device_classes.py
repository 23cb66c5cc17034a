"""The chart's DeviceClasses against the devices the plugin publishes.

Their CEL selectors are evaluated on the device documents of `build_pool` (MIG
dynamic and static, `--gpu-partitions`, plain GPUs): every device falls in exactly one
class, and the MIG class, which a tenant asks for to get hardware isolation, never
selects a time-shared `--gpu-partitions` partition.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest

from driver.devices import model as dm
from driver.nvml.discovered import MigInstance
from driver.nvml.mock.fleet import example_fleet, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from tests.unit.test_chart_render import DRIVER, render

Doc = dict[str, Any]

WHOLE, MIG, PARTITION = DRIVER, f"mig.{DRIVER}", f"partition.{DRIVER}"

# The CEL the chart's (and the demo's) selectors use: string literals, `==`, `&&`, `||`,
# `!`, parentheses, `in`, and three fields of `device`. Anything else fails the test
# instead of being guessed at.
_CEL_TOKEN = re.compile(
    r"\s*(?:(?P<literal>'[^'\\]*')|(?P<op>&&|\|\||==|!|\(|\)|\[|\])"
    r"|(?P<name>device\.driver|device\.attributes|device\.allowMultipleAllocations|in)\b)"
)
_CEL_TO_PYTHON = {"&&": " and ", "||": " or ", "!": " not "}


def cel_selects(expression: str, device: Doc, driver: str = DRIVER) -> bool:
    """Whether a selector of the chart's CEL subset selects a device document."""
    python: list[str] = []
    pos, end = 0, len(expression.rstrip())
    while pos < end:
        token = _CEL_TOKEN.match(expression, pos)
        assert token, f"CEL outside this test's subset at {expression[pos:]!r}"
        literal, op, name = token.group("literal", "op", "name")
        python.append(literal or (op and _CEL_TO_PYTHON.get(op, op)) or f" {name} ")
        pos = token.end()
    domains: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    for key, value in (device.get("attributes") or {}).items():
        domain, _, bare = key.rpartition("/")
        domains[domain or driver][bare] = value
    fields = SimpleNamespace(
        driver=driver,
        attributes=domains,
        allowMultipleAllocations=bool(device.get("allowMultipleAllocations")),
    )
    return bool(eval("".join(python), {"__builtins__": {}}, {"device": fields}))


def class_selectors(docs: list[Doc]) -> dict[str, str]:
    """DeviceClass name -> its (single) CEL selector."""
    out = {}
    for doc in docs:
        if doc["kind"] == "DeviceClass":
            (selector,) = doc["spec"]["selectors"]
            out[doc["metadata"]["name"]] = selector["cel"]["expression"]
    return out


def classes_of(device: Doc, selectors: dict[str, str]) -> list[str]:
    return [name for name, expr in selectors.items() if cel_selects(expr, device)]


def _pool(fleet: Any, options: dm.PoolOptions | None = None, **kwargs: Any) -> dm.PoolDevices:
    return dm.build_pool(MockBackend(MockNvml(fleet, "n1")).discover(), options, **kwargs)


def _static_pool() -> dm.PoolDevices:
    """GPU 0 with an administrator's MIG device (static), GPU 1 dynamic."""
    fleet = parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2}]})
    inventory = MockBackend(MockNvml(fleet, "n1")).discover()
    gpu = inventory.gpus[0]
    profile = next(p for p in gpu.partition_profiles if p.name == "3g.40gb")
    foreign = MigInstance(gpu.uuid, 2, profile.profile_id, (4, 4), ci_id=0, uuid="MIG-0002")
    gpus = (dataclasses.replace(gpu, mig_instances=(foreign,)), *inventory.gpus[1:])
    return dm.build_pool(dataclasses.replace(inventory, gpus=gpus))


POOLS = {
    "mig-dynamic": lambda: _pool(parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2}]})),
    "mig-static": _static_pool,
    "mig-off": lambda: _pool(
        parse_fleet({"gpus": [{"model": "A100-40GB", "count": 2, "migMode": "disabled"}]})
    ),
    "gpu-partitions": lambda: _pool(
        parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2}]}),
        dm.PoolOptions(gpu_partitions=4),
    ),
    "gpu-partitions-shared": lambda: _pool(
        example_fleet(2), dm.PoolOptions(gpu_partitions=2, allow_multiple_allocations=True)
    ),
}


@pytest.fixture(scope="module")
def selectors() -> dict[str, str]:
    return class_selectors(render())


@pytest.mark.parametrize("pool_name", POOLS)
def test_every_device_is_in_exactly_its_class(selectors: dict[str, str], pool_name: str) -> None:
    """Whole GPUs (and `gpu-<i>-full`) -> <driver>; MIG devices -> mig.<driver>;
    `--gpu-partitions` partitions -> partition.<driver>."""
    pool = POOLS[pool_name]()
    assert pool.devices
    for device in pool.devices:
        if not device.is_partition:
            expected = WHOLE
        elif device.mig is not None:
            expected = MIG
        else:
            expected = PARTITION
        assert classes_of(device.document, selectors) == [expected], device.name


def test_mig_class_never_selects_a_device_that_is_not_isolated(selectors: dict[str, str]) -> None:
    for make in POOLS.values():
        for device in make().devices:
            if cel_selects(selectors[MIG], device.document):
                assert device.document["attributes"]["isolated"] == {"bool": True}, device.name


def test_class_names_follow_the_driver_name() -> None:
    docs = render("--set", "driverName=gpu.acme.io")
    assert set(class_selectors(docs)) == {"gpu.acme.io", "mig.gpu.acme.io", "partition.gpu.acme.io"}
    for expr in class_selectors(docs).values():
        assert expr.startswith("device.driver == 'gpu.acme.io'")


def test_classes_can_be_renamed_and_disabled() -> None:
    docs = render(
        "--set", "deviceClasses.partition.name=mig-slices",
        "--set", "deviceClasses.gpuPartition.name=time-shared",
    )  # fmt: skip
    assert set(class_selectors(docs)) == {WHOLE, "mig-slices", "time-shared"}
    docs = render("--set", "deviceClasses.gpuPartition.enabled=false")
    assert set(class_selectors(docs)) == {WHOLE, MIG}


def test_device_class_extended_resource_names() -> None:
    """deviceClasses.<class>.extendedResourceName -> the DeviceClass's extendedResourceName
    (KEP-5004); unset by default, where only the implicit deviceclass.resource.kubernetes.io
    name exists."""
    for doc in render():
        if doc["kind"] == "DeviceClass":
            assert "extendedResourceName" not in doc["spec"], doc
    docs = render(
        "--set", "deviceClasses.gpu.extendedResourceName=example.com/gpu",
        "--set", "deviceClasses.partition.extendedResourceName=example.com/mig",
        "--set", "deviceClasses.gpuPartition.extendedResourceName=example.com/gpu-partition",
    )  # fmt: skip
    names = {
        d["metadata"]["name"]: d["spec"].get("extendedResourceName")
        for d in docs
        if d["kind"] == "DeviceClass"
    }
    assert names == {
        WHOLE: "example.com/gpu",
        MIG: "example.com/mig",
        PARTITION: "example.com/gpu-partition",
    }


@pytest.mark.parametrize(
    ("expression", "device", "selected"),
    [
        ("device.driver == 'gpu.example.com'", {}, True),
        ("device.driver == 'other'", {}, False),
        ("'a' in device.attributes['gpu.example.com']", {"attributes": {"a": {}}}, True),
        ("!('a' in device.attributes['gpu.example.com'])", {"attributes": {"a": {}}}, False),
        ("'a' in device.attributes['x.io'] || 'b' in device.attributes['x.io']",
         {"attributes": {"x.io/b": {}}}, True),
        ("device.allowMultipleAllocations && 'a' in device.attributes['gpu.example.com']",
         {"allowMultipleAllocations": True}, False),
    ],
)  # fmt: skip
def test_the_cel_subset_evaluator(expression: str, device: Doc, selected: bool) -> None:
    assert cel_selects(expression, device) is selected


def test_the_cel_subset_evaluator_refuses_other_cel() -> None:
    with pytest.raises(AssertionError, match="outside this test's subset"):
        cel_selects("device.attributes['gpu.example.com'].index != 0", {})
