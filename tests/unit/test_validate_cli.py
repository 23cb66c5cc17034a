"""`gpu-dra validate`: multi-document YAML files, one line per problem, exit codes."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from driver.cli import validate

DATA = Path(__file__).parent / "data" / "config"


def run_cli(*argv: str, stdin: str = "") -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="gpu-dra")
    validate.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["validate", *argv])
    out = io.StringIO()
    code = args.run(args, stdin=io.StringIO(stdin), out=out)
    return code, out.getvalue()


def test_valid_file_exits_zero_and_prints_nothing() -> None:
    code, out = run_cli(str(DATA / "valid.yaml"))
    assert (code, out) == (0, "")


def test_invalid_file_lists_every_problem() -> None:
    name = str(DATA / "invalid.yaml")
    code, out = run_cli(str(DATA / "valid.yaml"), name)
    assert code == 1
    assert out.splitlines() == [
        f"{name}: ResourceClaim/bad-claim: spec.devices.config[0].opaque.parameters"
        ".sharing.spacePartitioningConfig.partitionCount: must be >= 1, got 0",
        f"{name}: ResourceClaimTemplate/bad-template: spec.spec.devices.config[0].opaque"
        ".parameters.sharing.strategy: duplicate field",
        f"{name}: ResourceClaimTemplate/bad-template: spec.spec.devices.config[0].opaque"
        ".parameters.sharing.timeSlicingConfig.period: unknown field",
        f"{name}: GpuConfig/#3: sharing.spacePartitioningConfig.partitionCount: must be an integer",
    ]


def test_driver_name_selects_configs() -> None:
    # with another driver name, none of the invalid configs are ours; bare GpuConfigs still are
    code, out = run_cli("--driver-name", "other.example.com", str(DATA / "invalid.yaml"))
    assert code == 1
    assert [line.split(": ")[1] for line in out.splitlines()] == ["GpuConfig/#3"]


def test_stdin_and_unreadable_and_unparsable(tmp_path: Path) -> None:
    code, out = run_cli(
        "-", stdin="apiVersion: gpu.resource.example.com/v1alpha1\nkind: GpuConfig\n"
    )
    assert (code, out) == (0, "")
    code, out = run_cli("-", stdin="kind: GpuConfig\nsharing: {strategy: Fast}\n")
    assert code == 1
    assert out == "-: GpuConfig/#1: apiVersion: required field missing\n"
    missing = tmp_path / "nope.yaml"
    code, out = run_cli(str(missing))
    assert code == 1 and out.startswith(f"{missing}: cannot read:")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    code, out = run_cli(str(broken))
    assert code == 1 and out.startswith(f"{broken}: invalid YAML:")


def test_file_without_config_documents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pod = tmp_path / "pod.yaml"
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    code, out = run_cli(str(pod))
    assert (code, out) == (0, "")
    assert "no GpuConfig or claim documents found" in capsys.readouterr().err


def test_non_mapping_document_is_reported(tmp_path: Path) -> None:
    odd = tmp_path / "odd.yaml"
    odd.write_text("- just\n- a list\n")
    code, out = run_cli(str(odd))
    assert code == 1
    assert out == f"{odd}: document #1: <root>: must be an object\n"
