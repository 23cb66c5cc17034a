"""`gpu-dra validate --explain`: each claim request's CEL selectors (its DeviceClass's
and its own) evaluated on every published device, with DRA's CEL semantics, and the
selector that excludes each device named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from driver.cli.validate.cel_device import Selector, device_activation, parse_semver
from driver.devices.model import PoolOptions, build_pool
from driver.devices.slices import build_slice_documents
from driver.nvml.selection import select_backend
from tests.unit.test_validate_cli import run_cli

DRIVER = "gpu.example.com"
TYPO = 'device.attributes["gpu.example.com"].profile == "1g.10gbb"'


def _mig_slices(tmp_path: Path) -> Path:
    """ResourceSlices of one H100 in MIG mode (its MIG partitions published), as
    `gpu-dra inventory -o json` prints them."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"gpus": [{"model": "H100-80GB", "count": 1}]}))
    inventory = select_backend(mock=True, fleet_path=str(fleet), node_name="node-a").discover()
    docs = build_slice_documents(
        build_pool(inventory, PoolOptions()), driver=DRIVER, node_name="node-a"
    )
    path = tmp_path / "slices.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return path


def _claim(tmp_path: Path, *selectors: str, **extra: Any) -> Path:
    request = {"deviceClassName": f"mig.{DRIVER}", **extra}
    if selectors:
        request["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "small", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}},
    }
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(claim))
    return path


def test_a_profile_typo_excludes_every_device_and_the_output_names_the_selector(
    tmp_path: Path,
) -> None:
    slices = _mig_slices(tmp_path)
    claim = str(_claim(tmp_path, TYPO))
    code, out, err = run_cli("--explain", claim, "--slices", str(slices), "--devices")
    assert code == 1
    assert "1 request(s) cannot be allocated" in err
    lines = out.splitlines()
    assert lines[0].startswith("allocations not counted: no ResourceClaims given")
    assert lines[1].startswith("ResourceClaim/small: request mig (class mig.gpu.example.com): 0 of")
    assert "CANNOT ALLOCATE" in lines[1]
    devices = [x for x in lines[2:] if " on node-a: " in x]
    assert devices and all("excluded by" in x for x in devices)
    partitions = [x for x in devices if "-mig-" in x]
    assert partitions and all(
        f"spec.devices.requests[0].exactly.selectors[0] {TYPO!r} (false)" in x for x in partitions
    )
    whole = next(x for x in devices if x.startswith("  gpu-0 on node-a"))
    assert "class mig.gpu.example.com selector[0]" in whole  # the class excludes the GPU
    # Without --devices: the summary names the selector, how many it excluded and the
    # profiles the excluded devices have.
    code, summary, _ = run_cli("--explain", claim, "--slices", str(slices))
    assert code == 1
    assert not [x for x in summary.splitlines() if " on node-a: " in x]
    own = next(x for x in summary.splitlines() if f"exactly.selectors[0] {TYPO!r}: " in x)
    assert own.endswith(
        f"excluded {len(partitions)} of {len(partitions)} device(s): {len(partitions)} false"
    )
    assert "    profile of the excluded: 1g.10gb (" in summary


def test_the_right_profile_matches_and_capacity_and_count_are_checked(tmp_path: Path) -> None:
    slices = _mig_slices(tmp_path)
    right = 'device.attributes["gpu.example.com"].profile == "1g.10gb"'
    claim = str(_claim(tmp_path, right))
    code, out, err = run_cli("--explain", claim, "--slices", str(slices), "--devices")
    assert code == 0, err
    assert "gpu-0-mig-1g10gb-0 on node-a: matches" in out
    big = _claim(tmp_path, right, capacity={"requests": {"memory": "20Gi"}})
    code, out, _ = run_cli("--explain", str(big), "--slices", str(slices), "--devices")
    assert code == 1
    assert (
        "gpu-0-mig-1g10gb-0 on node-a: excluded by capacity: memory 9984Mi < 20Gi requested" in out
    )
    code, out, _ = run_cli("--explain", str(big), "--slices", str(slices))
    assert (
        "  capacity requests: excluded 7 of 7 device(s): memory 9984Mi < 20Gi requested (7)" in out
    )
    many = _claim(tmp_path, right, count=99)
    code, out, _ = run_cli("--explain", str(many), "--slices", str(slices))
    assert code == 1 and "99 needed: CANNOT ALLOCATE" in out


def test_slices_from_standard_input(tmp_path: Path) -> None:
    slices = _mig_slices(tmp_path).read_text()
    claim = str(_claim(tmp_path, TYPO))
    code, out, _ = run_cli("--explain", claim, "--slices", "-", "--devices", stdin=slices)
    assert code == 1 and "(false)" in out


def _device(**fields: Any) -> dict[str, Any]:
    return {"name": "d", **fields}


def test_dra_cel_semantics() -> None:
    device = _device(
        attributes={
            "profile": {"string": "1g.10gb"},
            "driverVersion": {"version": "580.65.6"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0"},
        },
        capacity={"memory": {"value": "10Gi"}},
        allowMultipleAllocations=True,
    )
    activation = device_activation(device, DRIVER)

    def check(expression: str) -> bool:
        return Selector(expression).matches(activation)

    assert check("device.driver == 'gpu.example.com' && device.allowMultipleAllocations")
    assert check("'pcieRoot' in device.attributes['resource.kubernetes.io']")  # its own domain
    assert not check("'profile' in device.attributes['other.io']")  # unknown domain: empty
    assert check("device.capacity['gpu.example.com'].memory.compareTo(quantity('10Gi')) == 0")
    assert check("device.capacity['gpu.example.com'].memory.isGreaterThan(quantity('9.5Gi'))")
    assert not check("device.capacity['gpu.example.com'].memory.isLessThan(quantity('1Gi'))")
    assert check(
        "device.attributes['gpu.example.com'].driverVersion.isGreaterThan(semver('550.0.0'))"
    )
    assert check("device.attributes['gpu.example.com'].driverVersion.major() == 580")
    assert check("isQuantity('1Gi') && !isQuantity('1x') && isSemver('1.0.0-rc.1')")
    assert parse_semver("1.0.0-rc.1").key() < parse_semver("1.0.0").key()
    for failing in (
        "device.attributes['gpu.example.com'].nope == 'x'",  # a missing id is an error
        "device.driver ==",  # does not compile
        "1 + 1",  # not a bool
    ):
        try:
            check(failing)
        except Exception as err:
            assert type(err).__name__ == "CelError", failing
        else:
            raise AssertionError(f"{failing} evaluated")
