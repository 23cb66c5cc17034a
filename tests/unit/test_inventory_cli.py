"""`gpu-dra inventory`: ResourceSlice documents for a mock fleet, and its errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli import main
from driver.devices.slices import validate_slice_specs

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@pytest.fixture(autouse=True)
def no_plugin_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No plugin data dir unless a test gives one: health is unknown."""
    monkeypatch.setenv("GPU_DRA_STATE_DIR", str(tmp_path / "no-plugin-here"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inventory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_mock_fleet_yaml(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        code, out, _ = run(capsys, "--mock", "--node-name", "n1", "-o", "yaml")
    assert code == 0
    docs: list[dict[str, Any]] = list(yaml.load_all(out, Loader=LOADER))
    assert len(docs) == 5
    assert all(
        d["kind"] == "ResourceSlice" and d["apiVersion"] == "resource.k8s.io/v1" for d in docs
    )
    specs = [d["spec"] for d in docs]
    assert validate_slice_specs(specs) == []
    devices = [dev for s in specs for dev in s.get("devices", [])]
    gpus = [dev for dev in devices if "-mig-" not in dev["name"]]
    assert [g["name"] for g in gpus] == [f"gpu-{i}" for i in range(8)]
    migs = [dev for dev in devices if "-mig-" in dev["name"]]
    assert len(migs) == 8 * 25
    assert all(m["consumesCounters"][0]["counterSet"].endswith("-counter-set") for m in migs)
    assert docs[0]["metadata"]["generateName"] == "00000-gpu.example.com-n1-"
    assert "USING MOCK NVML" in caplog.text  # the mock is announced loudly


def test_json_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "--mock",
        "example",
        "--node-name",
        "dra-example-driver-cluster-worker",
        "--driver-name",
        "gpu.acme.io",
        "--gpu-partitions",
        "2",
        "--node-uid",
        "u-1",
        "-o",
        "json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["kind"] == "List" and len(data["items"]) == 2
    first, second = data["items"]
    assert first["spec"]["driver"] == "gpu.acme.io"
    assert first["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert len(first["spec"]["sharedCounters"]) == 8
    names = [d["name"] for d in second["spec"]["devices"]][:3]
    assert names == ["gpu-0-partition-0", "gpu-0-partition-1", "gpu-0-full"]
    assert second["spec"]["devices"][0]["attributes"]["uuid"] == {
        "string": "gpu-18db0e85-99e9-c746-8531-ffeb86328b39"
    }


def test_table_is_the_default_and_health_is_unknown_without_a_plugin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--mock", "--node-name", "n1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["DEVICE", "MODEL", "MEMORY", "PARTITIONS", "SHARING", "HEALTH"]
    assert lines[1].split()[0] == "gpu-0" and "25" in lines[1] and "exclusive" in lines[1]
    assert lines[1].split()[-1] == "unknown"
    assert "Healthy" not in out
    assert "8 GPU(s), 208 device(s) in 5 slice(s)" in out
    assert "health unknown: no plugin data directory" in out and "--state-dir" in out
    code, out, _ = run(capsys, "--mock", "--node-name", "n1", "-o", "table", "--partitions")
    assert "gpu-0-mig-1g10gb-me-3" in out and "1g.10gb+me @3+1" in out


def test_table_health_from_the_plugins_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from driver.devices.model import build_pool
    from driver.health.store import HealthStore
    from driver.nvml.backend import select_backend

    state = tmp_path / "state"
    state.mkdir()
    # A data dir without health.json: the plugin has recorded no failure.
    code, out, _ = run(capsys, "--mock", "--node-name", "n1", "--state-dir", str(state))
    assert code == 0
    assert [line.split()[-1] for line in out.splitlines()[1:9]] == ["Healthy"] * 8
    assert f"health from {state / 'health.json'}" in out

    pool = build_pool(select_backend(mock=True, node_name="n1").discover())
    store = HealthStore(state / "health.json")
    store.record_xid(pool.device("gpu-3").gpu_uuid, 79)
    store.record_instance_xid(pool.device("gpu-5").gpu_uuid, (3, 1), 94)
    code, out, _ = run(
        capsys, "--mock", "--node-name", "n1", "--state-dir", str(state), "--partitions"
    )
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line.startswith("gpu-")}
    assert rows["gpu-3"].endswith("Unhealthy (gpu.example.com/xid=79:NoSchedule)")
    assert rows["gpu-3-mig-1g10gb-0"].endswith("Unhealthy (gpu.example.com/xid=79:NoSchedule)")
    assert rows["gpu-5-mig-1g10gb-3"].endswith("Unhealthy (gpu.example.com/xid=94:NoSchedule)")
    assert rows["gpu-5-mig-1g10gb-4"].endswith("Healthy")
    assert rows["gpu-0"].endswith("Healthy")
    before = (state / "health.json").read_bytes()

    # $GPU_DRA_STATE_DIR is the default; an unreadable store is unknown, and left alone.
    (state / "health.json").write_text("{not json")
    monkeypatch.setenv("GPU_DRA_STATE_DIR", str(state))
    code, out, _ = run(capsys, "--mock", "--node-name", "n1")
    assert code == 0 and "Healthy" not in out
    assert f"health unknown: {state / 'health.json'} is unreadable" in out
    assert (state / "health.json").read_text() == "{not json"
    assert sorted(p.name for p in state.iterdir()) == ["health.json"]
    assert before


def test_state_dir_given_but_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "--mock", "--state-dir", str(tmp_path / "nope"))
    assert (code, out) == (1, "")
    assert "--state-dir" in err and "no such directory" in err


def test_yaml_has_no_anchors(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--mock", "--node-name", "n1", "-o", "yaml")
    assert code == 0
    assert "&id" not in out and "*id" not in out
    docs = list(yaml.load_all(out, Loader=LOADER))
    assert docs[1]["spec"]["devices"][0]["attributes"]["model"]


def test_static_strategy_without_instances(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "--mock", "--node-name", "n1", "--mig-strategy", "static", "-o", "yaml"
    )
    docs = list(yaml.load_all(out, Loader=LOADER))
    assert code == 0
    assert [d for doc in docs for d in doc["spec"].get("devices", [])] == []
    assert err.count("nothing of it is published") == 8


def test_fleet_file_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("gpus:\n- model: A100-40GB\n  count: 16\n")
    code, out, _ = run(capsys, "--mock", str(fleet), "--node-name", "big", "-o", "json")
    assert code == 0
    specs = [d["spec"] for d in json.loads(out)["items"]]
    assert validate_slice_specs(specs) == []
    assert [len(s.get("sharedCounters", [])) for s in specs[:3]] == [8, 8, 0]
    fleet.write_text("gpus:\n- model: A100-40GB\n  colour: green\n")
    code, out, err = run(capsys, "--mock", str(fleet), "--node-name", "n")
    assert code == 1 and out == ""
    assert "gpus[0].colour: unknown field" in err


def test_negative_partitions_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["inventory", "--mock", "--gpu-partitions", "-1"])
    assert exc.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_without_nvml_library_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    def missing() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    code, out, err = run(capsys, "--node-name", "n1")
    assert code == 1 and out == ""
    assert "NVML is not available" in err and "--mock" in err


def test_mig_on_with_precreated_instances_shows_exactly_those(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    fleet = tmp_path / "static.yaml"
    fleet.write_text(
        "gpus:\n"
        "- model: H100-80GB\n"
        "  count: 1\n"
        "  migInstances: [{profile: 1g.10gb, start: 0}, {profile: 3g.40gb, start: 4}]\n"
        "- model: H100-80GB\n"
        "  count: 1\n"
    )
    code, out, _ = run(capsys, "--mock", str(fleet), "--node-name", "n1", "-o", "json")
    assert code == 0
    names = [d["name"] for doc in json.loads(out)["items"] for d in doc["spec"].get("devices", [])]
    gpu0 = [n for n in names if n == "gpu-0" or n.startswith("gpu-0-")]
    assert gpu0 == ["gpu-0-mig-1g10gb-0", "gpu-0-mig-3g40gb-4"]  # static: exactly those
    gpu1 = [n for n in names if n == "gpu-1" or n.startswith("gpu-1-")]
    assert "gpu-1" in gpu1 and len(gpu1) > 20  # MIG on, no instances: dynamic


def test_table_shows_devices_shared_by_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--mock", "example", "--node-name", "n1", "--gpu-partitions", "2", "--partitions")
    code, out, _ = run(capsys, *argv, "--gpu-allow-multiple-allocations")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line.startswith("gpu-")}
    assert "shares: compute step 1, memory step 1Gi" in rows["gpu-0-partition-1"]
    assert "shares: compute step 1, memory step 1Gi" in rows["gpu-0-full"]
    code, out, _ = run(capsys, *argv)
    assert "shares" not in out and "exclusive" in out

    argv = ("--mock", "example", "--gpu-allow-multiple-allocations", "-o", "json")
    code, out, _ = run(capsys, *argv)
    devices = [d for s in json.loads(out)["items"] for d in s["spec"].get("devices", [])]
    assert devices and all(d["allowMultipleAllocations"] is True for d in devices)
    assert devices[0]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Gi"
