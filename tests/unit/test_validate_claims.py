"""`gpu-dra validate`: what a claim's requests name. A claim without a GpuConfig is still
a claim for the driver; device class names, the requests a config names, and configs
that prepare always refuses (SpacePartitioning on a partition class, a partitionCount
no published device takes) are reported before the claim is applied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.devices.model import PoolOptions, build_pool
from driver.devices.slices import build_slice_documents
from driver.nvml.selection import select_backend
from tests.unit.test_validate_cli import problems, run_cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "demo"
DEMO_FILES = sorted(DEMO.rglob("*.yaml"))
DRIVER = "gpu.example.com"

Doc = dict[str, Any]


def template(requests: list[Doc], configs: list[Doc] | None = None, name: str = "t") -> Doc:
    devices: Doc = {"requests": requests}
    if configs is not None:
        devices["config"] = configs
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": devices}},
    }


def request(name: str, device_class: str = DRIVER) -> Doc:
    return {"name": name, "exactly": {"deviceClassName": device_class}}


def space_config(count: int, requests: list[str] | None = None, driver: str = DRIVER) -> Doc:
    entry: Doc = {
        "opaque": {
            "driver": driver,
            "parameters": {
                "apiVersion": "gpu.resource.example.com/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {
                    "strategy": "SpacePartitioning",
                    "spacePartitioningConfig": {"partitionCount": count},
                },
            },
        }
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def write(tmp_path: Path, *docs: Doc, name: str = "claims.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return path


def default_fleet_slices(tmp_path: Path, **options: Any) -> Path:
    """The ResourceSlices of the default mock fleet (8 H100s, MIG, maxPartitions 7), as
    `gpu-dra inventory --mock -o json` prints them."""
    inventory = select_backend(mock=True, fleet_path=None, node_name="node-a").discover()
    docs = build_slice_documents(
        build_pool(inventory, PoolOptions(**options)), driver=DRIVER, node_name="node-a"
    )
    path = tmp_path / "slices.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return path


# --- a claim without GpuConfig, the demo manifests one by one -------------------------


def test_a_claim_without_gpu_config_passes_alone(tmp_path: Path) -> None:
    claim = write(tmp_path, template([request("gpu")]))
    code, out, err = run_cli(str(claim))
    assert (code, err) == (0, "")
    assert out == f"OK: 1 GpuConfig/claim document(s) in 1 file(s) valid for driver {DRIVER}\n"


def _is_helm_values(path: Path) -> bool:
    return path.name.startswith("values")


@pytest.mark.parametrize(
    "path",
    [p for p in DEMO_FILES if not _is_helm_values(p)],
    ids=lambda p: str(p.relative_to(DEMO)),
)
def test_each_demo_manifest_passes_alone(path: Path) -> None:
    code, out, err = run_cli(str(path))
    assert (code, err) == (0, ""), err
    assert out.splitlines()[-1].startswith("OK: ")


@pytest.mark.parametrize(
    "path", [p for p in DEMO_FILES if _is_helm_values(p)], ids=lambda p: str(p.relative_to(DEMO))
)
def test_a_helm_values_file_is_not_a_manifest(path: Path) -> None:
    code, out, err = run_cli(str(path))
    assert (code, out) == (1, "")
    assert problems(err) == [
        f"{path}: <no kind>/#1: <root>: not a Kubernetes object or GpuConfig (no apiVersion "
        "and kind)"
    ]


def test_the_demo_manifests_pass_together_as_alone() -> None:
    manifests = [str(p) for p in DEMO_FILES if not _is_helm_values(p)]
    code, out, err = run_cli(*manifests)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1].endswith(f"in {len(manifests)} file(s) valid for driver {DRIVER}")
    # demo/ itself also holds the Helm values of `make demo`: skipped, with a note
    code, out, err = run_cli(str(DEMO))
    assert (code, err) == (0, "")
    assert f"{DEMO / 'values-demo.yaml'}: skipped: no document has apiVersion or kind" in out
    assert out.splitlines()[-1].startswith("OK: ")


def test_a_manifest_with_nothing_to_check_passes(tmp_path: Path) -> None:
    """Pods and Namespaces only (demo/12-extended-resources.yaml): valid, nothing to check,
    and said so."""
    pod = tmp_path / "pod.yaml"
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    code, out, err = run_cli(str(pod))
    assert (code, err) == (0, "")
    assert out == (
        f"OK: nothing to check for driver {DRIVER}: no GpuConfig or claim document in 1 file(s)\n"
    )


# --- device class names ---------------------------------------------------------------


def test_a_misspelt_device_class_is_reported(tmp_path: Path) -> None:
    claim = write(tmp_path, template([request("gpu", "gpu.exmaple.com")]))
    code, out, err = run_cli(str(claim))
    assert (code, out) == (1, "")
    assert problems(err) == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.requests[0].exactly.deviceClassName: "
        f"unknown device class 'gpu.exmaple.com' (did you mean '{DRIVER}'?); the classes of "
        f"{DRIVER} are {DRIVER}, mig.{DRIVER}, partition.{DRIVER}; --device-class adds others"
    ]


def test_another_drivers_class_beside_the_drivers_is_a_note_not_a_failure(
    tmp_path: Path,
) -> None:
    """A GPU and a NIC in one claim: the NIC's class is another driver's, which the tool
    cannot know unless the files hold it. Only the driver's classes are checked; the
    other is named in a note, and the claim passes."""
    claim = write(tmp_path, template([request("gpu"), request("nic", "nic.example.com")]))
    code, out, err = run_cli(str(claim))
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.requests[1].exactly"
        ".deviceClassName: note: device class 'nic.example.com' not checked: not a class of "
        f"{DRIVER} ({DRIVER}, mig.{DRIVER}, partition.{DRIVER}; --device-class adds others) "
        "nor a DeviceClass in the given files",
        f"OK: 1 GpuConfig/claim document(s) in 1 file(s) valid for driver {DRIVER}",
    ]


def test_an_unknown_class_in_a_sub_request_is_a_note(tmp_path: Path) -> None:
    """A class name nothing like the driver's, beside a request for it: a note naming
    it, as for any class the tool cannot know."""
    first_available = {
        "name": "gpu",
        "firstAvailable": [
            {"name": "big", "deviceClassName": f"mig.{DRIVER}"},
            {"name": "any", "deviceClassName": "accelerators"},
        ],
    }
    claim = write(tmp_path, template([first_available]))
    code, out, err = run_cli(str(claim))
    assert (code, err) == (0, "")
    assert out.startswith(
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.requests[0].firstAvailable[1]"
        ".deviceClassName: note: device class 'accelerators' not checked: not a class of"
    )


def test_device_class_flag_and_given_device_classes_are_known(tmp_path: Path) -> None:
    claim = write(tmp_path, template([request("gpu", "gpu.exmaple.com")]))
    assert run_cli(str(claim), "--device-class", "gpu.exmaple.com")[0] == 0
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.exmaple.com"},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
    }
    classes = write(tmp_path, device_class, name="class.yaml")
    code, _, err = run_cli(str(claim), str(classes))
    assert (code, err) == (0, "")


def test_renamed_driver_classes_follow_driver_name(tmp_path: Path) -> None:
    claim = write(
        tmp_path, template([request("a", "gpu.acme.io"), request("b", "mig.gpu.acme.io")])
    )
    code, _, err = run_cli("--driver-name", "gpu.acme.io", str(claim))
    assert (code, err) == (0, "")
    code, _, err = run_cli(str(claim))  # for gpu.example.com they are another driver's
    assert code == 1 and "matches no document" in err


def test_v1beta1_requests_are_read(tmp_path: Path) -> None:
    claim: Doc = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "a", "deviceClassName": DRIVER},
                    {"name": "b", "deviceClassName": "gpu.exmaple.com"},
                ]
            }
        },
    }
    code, _, err = run_cli(str(write(tmp_path, claim)))
    assert code == 1
    [line] = problems(err)
    assert (
        ": ResourceClaim/c: spec.devices.requests[1].deviceClassName: unknown device class" in line
    )


# --- the requests a config names ------------------------------------------------------


def test_a_config_naming_no_request_of_the_claim_is_reported(tmp_path: Path) -> None:
    subrequests = {
        "name": "gpu",
        "firstAvailable": [{"name": "big", "deviceClassName": DRIVER}],
    }
    config = dict(space_config(2, ["gpus", "gpu/big", "gpu/small"]))
    claim = write(tmp_path, template([subrequests], [config]))
    code, _, err = run_cli(str(claim))
    assert code == 1
    assert problems(err) == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.config[0].requests[{i}]: "
        f"no request '{name}' in this claim (requests: gpu, gpu/big)"
        for i, name in ((0, "gpus"), (2, "gpu/small"))
    ]


# --- SpacePartitioning on partition classes -------------------------------------------


@pytest.mark.parametrize("device_class", [f"mig.{DRIVER}", f"partition.{DRIVER}"])
def test_space_partitioning_on_a_partition_class_is_reported(
    tmp_path: Path, device_class: str
) -> None:
    claim = write(
        tmp_path,
        template([request("whole"), request("part", device_class)], [space_config(2)]),
    )
    code, _, err = run_cli(str(claim))
    assert code == 1
    assert problems(err) == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.config[0].opaque.parameters"
        f".sharing.strategy: SpacePartitioning fails at prepare for request 'part': class "
        f"{device_class} gives partitions, which cannot be split further; use TimeSlicing "
        "or no sharing config for it"
    ]


def test_a_time_slice_interval_on_mig_devices_is_reported(tmp_path: Path) -> None:
    """A MIG device has no time-slice interval: prepare refuses a non-Default one."""

    def interval(value: str) -> Doc:
        return {
            "requests": ["part"],
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": "gpu.resource.example.com/v1alpha1",
                    "kind": "GpuConfig",
                    "sharing": {
                        "strategy": "TimeSlicing",
                        "timeSlicingConfig": {"interval": value},
                    },
                },
            },
        }

    requests = [request("whole"), request("part", f"mig.{DRIVER}")]
    claim = write(tmp_path, template(requests, [interval("Long")]))
    code, _, err = run_cli(str(claim))
    assert code == 1
    assert problems(err) == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.config[0].opaque.parameters"
        f".sharing.timeSlicingConfig.interval: Long fails at prepare for request 'part': "
        f"class mig.{DRIVER} gives MIG devices, which have no time-slice interval; use a "
        "GPU with MIG mode off, or no interval"
    ]
    assert run_cli(str(write(tmp_path, template(requests, [interval("Default")]))))[0] == 0


def interval_config(value: str, requests: list[str] | None = None) -> Doc:
    entry: Doc = {
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": "gpu.resource.example.com/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": value}},
            },
        }
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def fleet_slices(tmp_path: Path, fleet: str) -> Path:
    """The ResourceSlices of a mock fleet given as YAML."""
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(fleet)
    inventory = select_backend(mock=True, fleet_path=fleet_path, node_name="node-a").discover()
    docs = build_slice_documents(
        build_pool(inventory, PoolOptions()), driver=DRIVER, node_name="node-a"
    )
    path = tmp_path / "fleet-slices.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return path


def test_a_time_slice_interval_no_published_device_takes_is_reported(tmp_path: Path) -> None:
    """With --slices: every device of the request's class carries `migProfile` (the
    default fleet's GPUs are all in MIG mode, each whole GPU a full-size MIG device), so
    prepare refuses the interval on whichever is allocated."""
    claim = write(tmp_path, template([request("gpu")], [interval_config("Long")]))
    code, _, err = run_cli(str(claim), "--slices", str(default_fleet_slices(tmp_path)))
    assert code == 1
    assert problems(err) == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.config[0].opaque.parameters"
        ".sharing.timeSlicingConfig.interval: Long fails at prepare for request 'gpu' on "
        f"every device of class {DRIVER} in the given slices (each is a MIG device, which "
        "has no time-slice interval: gpu-0 on node-a, ...); use a GPU with MIG mode off, "
        "or no interval"
    ]
    assert run_cli(str(claim))[0] == 0  # without slices the devices are unknown
    default = write(tmp_path, template([request("gpu")], [interval_config("Default")]))
    assert run_cli(str(default), "--slices", str(default_fleet_slices(tmp_path)))[0] == 0
    # One GPU with MIG mode off takes it: the claim may get that one.
    mixed = fleet_slices(
        tmp_path,
        "gpus:\n- model: H100-80GB\n  count: 1\n- model: A100-40GB\n  count: 1\n"
        "  migMode: disabled\n",
    )
    code, _, err = run_cli(str(claim), "--slices", str(mixed))
    assert (code, err) == (0, "")


def test_a_time_slice_interval_on_a_class_of_mig_devices_given_by_name(tmp_path: Path) -> None:
    """A class named with --device-class may select only MIG partitions: every device
    --slices publishes is one, so the interval fails at prepare."""
    mig_only = fleet_slices(tmp_path, "gpus:\n- model: H100-80GB\n  count: 1\n")
    claim = write(
        tmp_path, template([request("gpu", "mig-1g.example")], [interval_config("Short")])
    )
    code, _, err = run_cli(
        str(claim), "--device-class", "mig-1g.example", "--slices", str(mig_only)
    )
    assert code == 1
    [line] = problems(err)
    assert (
        "Short fails at prepare for request 'gpu' on every device of class mig-1g.example" in line
    )


def test_a_later_config_for_the_partition_request_overrides(tmp_path: Path) -> None:
    """The last matching config wins as a whole, as at prepare."""
    time_slicing = {
        "requests": ["part"],
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": "gpu.resource.example.com/v1alpha1", "kind": "GpuConfig"},
        },
    }
    claim = write(
        tmp_path,
        template(
            [request("whole"), request("part", f"mig.{DRIVER}")],
            [space_config(2), time_slicing],
        ),
    )
    code, _, err = run_cli(str(claim))
    assert (code, err) == (0, "")


# --- partitionCount against the published maxPartitions -------------------------------


def test_partition_count_above_every_published_max_partitions_is_reported(
    tmp_path: Path,
) -> None:
    slices = default_fleet_slices(tmp_path)
    fits = write(tmp_path, template([request("gpu")], [space_config(7)]), name="fits.yaml")
    code, _, err = run_cli(str(fits), "--slices", str(slices))
    assert (code, err) == (0, "")
    too_many = write(tmp_path, template([request("gpu")], [space_config(8)]), name="many.yaml")
    code, _, err = run_cli(str(too_many), "--slices", str(slices))
    assert code == 1
    assert problems(err) == [
        f"{too_many}: ResourceClaimTemplate/t: spec.spec.devices.config[0].opaque.parameters"
        ".sharing.spacePartitioningConfig.partitionCount: fails at prepare for request 'gpu' "
        f"on every device of class {DRIVER} in the given slices (largest maxPartitions: 7, "
        "gpu-0 on node-a)"
    ]
    assert run_cli(str(too_many))[0] == 0  # without slices the limit is unknown


def test_the_permanent_error_scenario_fails_against_the_default_fleet(tmp_path: Path) -> None:
    scenario = DEMO / "scenarios" / "permanent-error.yaml"
    code, _, err = run_cli(str(scenario), "--slices", str(default_fleet_slices(tmp_path)))
    assert code == 1
    [line] = problems(err)
    assert "partitionCount: fails at prepare for request 'gpu'" in line


def test_shared_gpus_take_no_space_partitioning(tmp_path: Path) -> None:
    """Every allocation of a multi-allocatable device is a share, which prepare never
    space-partitions: with every GPU shared by capacity the config always fails."""
    slices = default_fleet_slices(tmp_path, gpu_partitions=2, allow_multiple_allocations=True)
    claim = write(tmp_path, template([request("gpu")], [space_config(2)]))
    code, _, err = run_cli(str(claim), "--slices", str(slices))
    assert code == 1
    [line] = problems(err)
    assert f"on every device of class {DRIVER} in the given slices" in line
    assert "shared by capacity" in line
