"""`gpu-dra validate`: multi-document YAML files, Lists, directories, stdin, exit codes."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from driver.cli.validate import validate_command

DATA = Path(__file__).parent / "data" / "config"

CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "c1", "namespace": "default"},
    "spec": {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}],
            "config": [
                {
                    "opaque": {
                        "driver": "gpu.example.com",
                        "parameters": {
                            "apiVersion": "gpu.resource.example.com/v1alpha1",
                            "kind": "GpuConfig",
                            "sharing": {"strategy": "TimeSlicing"},
                        },
                    }
                }
            ],
        }
    },
}


def bad_claim(name: str) -> dict[str, object]:
    claim = json.loads(json.dumps(CLAIM))
    claim["metadata"]["name"] = name
    claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["strategy"] = "Fast"
    return dict(claim)


def run_cli(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="gpu-dra")
    validate_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["validate", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = args.run(args, stdin=io.StringIO(stdin), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def problems(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("gpu-dra validate:")]


def test_valid_file_prints_a_summary() -> None:
    code, out, err = run_cli(str(DATA / "valid.yaml"))
    assert (code, err) == (0, "")
    # valid.yaml's bare GpuConfig asks for SpacePartitioning: one note, then the summary.
    assert out.count("\n") == 2
    assert out.splitlines()[0] == SPACE_NOTE.format(
        f"{DATA / 'valid.yaml'}: GpuConfig/#2: sharing.strategy"
    )
    assert out.splitlines()[1].startswith("OK: ")
    assert "in 1 file(s)" in out and "gpu.example.com" in out


SPACE_NOTE = (
    "{}: note: SpacePartitioning is limited only on nodes that run MPS (devices with the "
    "attribute mpsIsolation: cooperative): each CUDA process, not the claim, gets "
    "1/partitionCount of the GPU's memory and SMs, and a process that bypasses MPS is not "
    "limited; elsewhere it is advisory: the container gets GPU_DEVICE_<id>_PARTITION_COUNT"
)


def test_space_partitioning_gets_one_note_per_claim_and_still_passes() -> None:
    """SpacePartitioning is env only where the node runs no MPS: said once per document, on
    stdout, without failing validation; TimeSlicing and other drivers' configs get none."""
    claim = json.loads(json.dumps(CLAIM))
    configs = claim["spec"]["devices"]["config"]
    spaced = json.loads(json.dumps(configs[0]))
    spaced["opaque"]["parameters"]["sharing"] = {"strategy": "SpacePartitioning"}
    other = json.loads(json.dumps(spaced))
    other["opaque"]["driver"] = "other.example.com"
    other["requests"] = ["other"]
    configs[:] = [configs[0], other, spaced, spaced]
    claim["spec"]["devices"]["requests"].append(
        {"name": "other", "exactly": {"deviceClassName": "other-devices"}}
    )
    other_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "other-devices"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'other.example.com'"}}]},
    }
    stdin = f"{json.dumps(claim)}\n---\n{json.dumps(other_class)}"
    code, out, err = run_cli("-", stdin=stdin)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        SPACE_NOTE.format(
            "-: ResourceClaim/c1: spec.devices.config[2].opaque.parameters.sharing.strategy"
        ),
        "OK: 2 GpuConfig/claim document(s) in 1 file(s) valid for driver gpu.example.com",
    ]
    code, out, _ = run_cli("-", stdin=json.dumps(CLAIM))  # TimeSlicing: no note
    assert code == 0 and out.startswith("OK: ")


def test_invalid_file_lists_every_problem_on_stderr() -> None:
    name = str(DATA / "invalid.yaml")
    code, out, err = run_cli(str(DATA / "valid.yaml"), name)
    assert code == 1 and [line for line in out.splitlines() if "note:" not in line] == []
    assert problems(err) == [
        f"{name}: ResourceClaim/bad-claim: spec.devices.config[0].opaque.parameters"
        ".sharing.spacePartitioningConfig.partitionCount: must be >= 1, got 0",
        f"{name}: ResourceClaimTemplate/bad-template: spec.spec.devices.config[0].opaque"
        ".parameters.sharing.strategy: duplicate field",
        f"{name}: ResourceClaimTemplate/bad-template: spec.spec.devices.config[0].opaque"
        ".parameters.sharing.timeSlicingConfig.period: unknown field",
        f"{name}: GpuConfig/#3: sharing.spacePartitioningConfig.partitionCount: must be an integer",
    ]
    assert err.splitlines()[-1] == "gpu-dra validate: 4 problem(s) found"


def test_driver_name_selects_configs() -> None:
    # with another driver name, none of the invalid configs are ours; bare GpuConfigs still are
    code, _, err = run_cli("--driver-name", "other.example.com", str(DATA / "invalid.yaml"))
    assert code == 1
    assert [line.split(": ")[1] for line in problems(err)] == ["GpuConfig/#3"]


def test_driver_name_matching_no_document_fails(tmp_path: Path) -> None:
    claim = tmp_path / "claim.json"
    claim.write_text(json.dumps(CLAIM))
    code, out, err = run_cli(str(claim))
    assert (code, err) == (0, "")
    code, out, err = run_cli("--driver-name", "gpu.acme.io", str(claim))
    assert (code, out) == (1, "")
    assert err == (
        "gpu-dra validate: --driver-name gpu.acme.io matches no document: no GpuConfig, no "
        "claim asking for its classes and no opaque config for it (opaque configs found "
        "for: gpu.example.com)\n"
    )


def test_kind_list_and_typed_lists(tmp_path: Path) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text(
        json.dumps({"apiVersion": "v1", "kind": "List", "items": [CLAIM, bad_claim("b1")]})
    )
    code, out, err = run_cli(str(listed))
    assert (code, out) == (1, "")
    assert problems(err) == [
        f"{listed}: List/#1: items[1]: ResourceClaim/b1: spec.devices.config[0].opaque"
        ".parameters.sharing.strategy: unknown GPU sharing strategy: 'Fast' (must be one of "
        "TimeSlicing, SpacePartitioning, MPS)"
    ]
    typed = tmp_path / "typed.yaml"
    typed.write_text(
        json.dumps(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimList",
                "metadata": {"resourceVersion": "1"},
                "items": [CLAIM, CLAIM],
            }
        )
    )
    code, out, err = run_cli(str(typed))
    assert (code, err) == (0, "")
    assert out.startswith("OK: 2 GpuConfig/claim document(s) in 1 file(s)")


def test_list_with_bad_items_is_reported(tmp_path: Path) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("apiVersion: v1\nkind: List\nitems: {a: 1}\n")
    code, _, err = run_cli(str(listed))
    assert code == 1 and f"{listed}: List/#1: items: must be a list" in err


def test_stdin(tmp_path: Path) -> None:
    code, out, err = run_cli(
        "-", stdin="apiVersion: gpu.resource.example.com/v1alpha1\nkind: GpuConfig\n"
    )
    assert (code, err) == (0, "") and out.startswith("OK: 1 ")
    code, out, err = run_cli("-", stdin="kind: GpuConfig\nsharing: {strategy: Fast}\n")
    assert (code, out) == (1, "")
    assert problems(err) == ["-: GpuConfig/#1: apiVersion: required field missing"]
    code, out, err = run_cli("-", stdin=json.dumps({"kind": "List", "items": [CLAIM]}))
    assert code == 0 and out.startswith("OK: 1 ")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    code, out, err = run_cli(str(missing))
    assert (code, out) == (1, "")
    assert problems(err) == [f"{missing}: no such file or directory"]


def test_unreadable_and_unparsable(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    code, _, err = run_cli(str(broken))
    assert code == 1 and err.startswith(f"{broken}: invalid YAML:")
    unreadable = tmp_path / "dir.yaml"
    unreadable.mkdir()
    (unreadable / "x.txt").write_text("")
    code, _, err = run_cli(str(unreadable))
    assert code == 1 and "directory has no *.yaml, *.yml, *.json files" in err


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code, out, err = run_cli(str(empty))
    assert (code, out) == (1, "")
    assert problems(err) == [f"{empty}: empty: no YAML documents"]
    comments = tmp_path / "comments.yaml"
    comments.write_text("# nothing\n---\n")
    code, _, err = run_cli(str(comments))
    assert code == 1 and f"{comments}: empty: no YAML documents" in err


def test_directory(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(json.dumps(CLAIM))
    (tmp_path / "b.json").write_text(json.dumps(CLAIM))
    (tmp_path / "c.yml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: n}\n")
    (tmp_path / "notes.txt").write_text("not yaml: [")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.yaml").write_text("a: [1\n")  # not recursive
    code, out, err = run_cli(str(tmp_path))
    assert (code, err) == (0, "")
    assert out.startswith("OK: 2 GpuConfig/claim document(s) in 3 file(s)")
    (tmp_path / "z.yaml").write_text(json.dumps(bad_claim("bad")))
    code, out, err = run_cli(str(tmp_path))
    assert (code, out) == (1, "")
    assert problems(err)[0].startswith(f"{tmp_path / 'z.yaml'}: ResourceClaim/bad: ")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    code, _, err = run_cli(str(empty_dir))
    assert code == 1
    assert problems(err) == [f"{empty_dir}: directory has no *.yaml, *.yml, *.json files"]


def test_non_mapping_document_is_reported(tmp_path: Path) -> None:
    odd = tmp_path / "odd.yaml"
    odd.write_text("- just\n- a list\n")
    code, _, err = run_cli(str(odd))
    assert code == 1
    assert problems(err) == [f"{odd}: document #1: <root>: must be an object"]


def _capacity_claim(name: str, **requests: str) -> dict[str, object]:
    claim = json.loads(json.dumps(CLAIM))
    claim["metadata"]["name"] = name
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": requests}
    return dict(claim)


def _shared_slices(tmp_path: Path) -> Path:
    """ResourceSlices of 8 `example` GPUs (80Gi, compute 100) shareable by capacity, as
    `gpu-dra inventory -o json` prints them."""
    from driver.devices.model import PoolOptions, build_pool
    from driver.devices.slices import build_slice_documents
    from driver.nvml.selection import select_backend

    inventory = select_backend(mock=True, fleet_path="example", node_name="node-a").discover()
    options = PoolOptions(allow_multiple_allocations=True)
    docs = build_slice_documents(
        build_pool(inventory, options), driver="gpu.example.com", node_name="node-a"
    )
    path = tmp_path / "slices.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return path


def test_capacity_requests_checked_against_published_slices(tmp_path: Path) -> None:
    slices = _shared_slices(tmp_path)
    fits = tmp_path / "fits.json"
    fits.write_text(json.dumps(_capacity_claim("fits", memory="16Gi", compute="20")))
    assert run_cli(str(fits), "--slices", str(slices))[0] == 0

    too_big = tmp_path / "too-big.json"
    too_big.write_text(json.dumps(_capacity_claim("too-big", memory="100Gi", compute="20")))
    code, _, err = run_cli(str(too_big), "--slices", str(slices))
    assert code == 1
    [line] = problems(err)
    assert "ResourceClaim/too-big: spec.devices.requests[0].exactly.capacity.requests:" in line
    assert "compute=20, memory=100Gi" in line and "largest memory: 80Gi" in line

    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps(_capacity_claim("unknown", bandwidth="1")))
    code, _, err = run_cli(str(unknown), "--slices", str(slices))
    assert code == 1 and "no device has a bandwidth capacity" in err


def test_capacity_not_checked_without_slices_or_against_other_drivers(tmp_path: Path) -> None:
    too_big = tmp_path / "too-big.json"
    too_big.write_text(json.dumps(_capacity_claim("too-big", memory="100Gi")))
    assert run_cli(str(too_big))[0] == 0
    slices = _shared_slices(tmp_path)
    code, _, err = run_cli(str(too_big), "--slices", str(slices), "--driver-name", "other.io")
    assert code == 1 and "publish no device of this driver" in err


def test_unreadable_slices_file_is_reported(tmp_path: Path) -> None:
    claim = tmp_path / "claim.json"
    claim.write_text(json.dumps(CLAIM))
    code, _, err = run_cli(str(claim), "--slices", str(tmp_path / "missing.yaml"))
    assert code == 1 and f"--slices {tmp_path / 'missing.yaml'}: cannot read" in err


def test_claim_with_only_capacity_requests_counts_for_the_driver_of_the_slices(
    tmp_path: Path,
) -> None:
    """A share claim without an opaque config (demo/11-shared-gpu-capacity.yaml) is checked
    for the driver when --slices publishes devices of it, and without --slices it is the
    driver's by its device class."""
    claim = json.loads(json.dumps(_capacity_claim("share", memory="16Gi", compute="20")))
    del claim["spec"]["devices"]["config"]
    share = tmp_path / "share.json"
    share.write_text(json.dumps(claim))
    code, out, err = run_cli(str(share), "--slices", str(_shared_slices(tmp_path)))
    assert (code, err) == (0, ""), err
    assert out.startswith("OK: 1 GpuConfig/claim document(s) in 1 file(s)")
    code, out, err = run_cli(str(share))
    assert (code, err) == (0, "")
    assert out.startswith("OK: 1 GpuConfig/claim document(s) in 1 file(s)")


def test_a_yaml_error_is_one_line_naming_file_line_and_column(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: v1\nkind: Namespace\n---\na: [1\nb: 2\n")
    code, out, err = run_cli(str(broken))
    assert (code, out) == (1, "")
    assert problems(err) == [
        f"{broken}: invalid YAML: line 5, column 2: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence from line 4, column 4)"
    ]
    indented = tmp_path / "indented.yaml"
    indented.write_text("a: 1\n b: 2\n")
    code, _, err = run_cli(str(indented))
    assert problems(err) == [
        f"{indented}: invalid YAML: line 2, column 3: mapping values are not allowed here"
    ]


def test_a_yaml_reader_error_names_line_and_column(tmp_path: Path) -> None:
    control = tmp_path / "control.yaml"
    control.write_text("a: 1\nb: \x07\n")
    code, _, err = run_cli(str(control))
    assert code == 1
    assert problems(err) == [
        f"{control}: invalid YAML: line 2, column 4: unacceptable character #x0007: "
        "special characters are not allowed"
    ]


def _default_fleet_slices(tmp_path: Path, gpu_partitions: int) -> Path:
    from driver.devices.model import PoolOptions, build_pool
    from driver.devices.slices import build_slice_documents
    from driver.nvml.selection import select_backend

    inventory = select_backend(mock=True, fleet_path=None, node_name="node-a").discover()
    assert {gpu.memory_bytes for gpu in inventory.gpus} == {85520809984}  # H100 80GB
    options = PoolOptions(gpu_partitions=gpu_partitions, allow_multiple_allocations=True)
    docs = build_slice_documents(
        build_pool(inventory, options), driver="gpu.example.com", node_name="node-a"
    )
    slices = tmp_path / "slices.json"
    slices.write_text(json.dumps({"kind": "List", "items": docs}))
    return slices


def test_capacity_errors_print_quantities_not_bytes(tmp_path: Path) -> None:
    """An H100's 85520809984 bytes are written as the API server writes them, 81559Mi."""
    slices = _default_fleet_slices(tmp_path, gpu_partitions=1)
    claim = tmp_path / "claim.json"
    claim.write_text(json.dumps(_capacity_claim("big", memory="100Gi")))
    code, _, err = run_cli(str(claim), "--slices", str(slices))
    assert code == 1
    [line] = problems(err)
    assert line.endswith(
        "memory=100Gi: no single device offers this much "
        "(largest memory: 81559Mi (gpu-0-full on node-a))"
    )
    assert "85520809984" not in line


def test_a_memory_no_binary_suffix_divides_is_also_shown_approximately(tmp_path: Path) -> None:
    """A third of an H100 (28506936661 bytes, published so) gets a readable size beside
    the exact one. A request is checked against the devices its chart class selects:
    30Gi fits the whole GPU gpu-0-full (class gpu.example.com), no partition."""
    slices = _default_fleet_slices(tmp_path, gpu_partitions=3)
    claim = json.loads(json.dumps(_capacity_claim("big", memory="30Gi")))
    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = (
        "partition.gpu.example.com"
    )
    path = tmp_path / "claim.json"
    path.write_text(json.dumps(claim))
    code, _, err = run_cli(str(path), "--slices", str(slices))
    assert code == 1
    [line] = problems(err)
    assert line.endswith(
        "memory=30Gi: no single device offers this much "
        "(largest memory: 28506936661 (~26.5Gi) (gpu-0-partition-0 on node-a))"
    )
    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.example.com"
    path.write_text(json.dumps(claim))
    assert run_cli(str(path), "--slices", str(slices))[0] == 0


def test_a_directory_skips_files_that_hold_no_manifests(tmp_path: Path) -> None:
    """The project's own demo/ keeps a Helm values file beside its manifests: a
    directory's file without apiVersion or kind in any document is skipped, with a
    note; named on its own it is checked (and fails)."""
    (tmp_path / "claim.yaml").write_text(json.dumps(CLAIM))
    values = tmp_path / "values-demo.yaml"
    values.write_text("kubeletPlugin:\n  migStrategy: dynamic\n")
    code, out, err = run_cli(str(tmp_path))
    assert (code, err) == (0, "")
    assert f"{values}: skipped: no document has apiVersion or kind" in out
    assert "in 1 file(s)" in out
    code, _, err = run_cli(str(values))
    assert code == 1 and "not a Kubernetes object or GpuConfig" in err


def test_the_projects_demo_directory_validates() -> None:
    demo = Path(__file__).resolve().parents[2] / "demo"
    code, out, err = run_cli(str(demo))
    assert (code, err) == (0, ""), err
    assert out.splitlines()[-1].startswith("OK: ")


def test_a_kind_that_is_no_string_is_one_problem_not_a_crash(tmp_path: Path) -> None:
    odd = tmp_path / "odd.yaml"
    odd.write_text("apiVersion: resource.k8s.io/v1\nkind: [a]\n")
    code, out, err = run_cli(str(odd))
    assert (code, out) == (1, "")
    assert problems(err) == [
        f"{odd}: <no kind>/#1: <root>: not a Kubernetes object or GpuConfig (no kind)"
    ]
