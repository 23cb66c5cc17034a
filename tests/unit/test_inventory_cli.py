"""`gpu-dra inventory`: ResourceSlice documents for a mock fleet, and its errors."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli import main
from driver.devices.slices import validate_slice_specs
from driver.nvml.mock.fleet import mock_gpu_uuid

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@pytest.fixture(autouse=True)
def no_plugin_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No plugin data dir unless a test gives one: health is unknown. No plugin
    answers /status either (port 1: refused)."""
    monkeypatch.setenv("GPU_DRA_STATE_DIR", str(tmp_path / "no-plugin-here"))
    monkeypatch.setenv("HTTP_PORT", "1")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inventory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def table(out: str) -> list[dict[str, str]]:
    """The table's rows as column -> cell, cut at the header's column starts (headers
    may hold a space: PCI BUS ID)."""
    lines = out.split("\n\n", 1)[0].splitlines()
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"(?:(?<=  )|^)\S", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return [
        {n: line[a:b].strip() for n, a, b in zip(names, starts, [*starts[1:], None], strict=True)}
        for line in lines[1:]
    ]


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
        "string": mock_gpu_uuid("dra-example-driver-cluster-worker", 0, prefix="gpu")
    }


def test_table_is_the_default_and_health_is_unknown_without_a_plugin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--mock", "--node-name", "n1")
    assert code == 0
    lines = out.splitlines()
    assert table(out)[0]["DEVICE"] == "gpu-0"
    assert table(out)[0]["PARTITIONS"] == "25" and table(out)[0]["SHARING"] == "exclusive"
    assert lines[1].split()[-1] == "unknown"
    assert "Healthy" not in out
    assert "8 GPU(s), 208 device(s) in 5 slice(s)" in out
    assert "health unknown: no plugin data directory" in out and "--state-dir" in out
    code, out, _ = run(capsys, "--mock", "--node-name", "n1", "-o", "table", "--partitions")
    row = {r["DEVICE"]: r for r in table(out)}["gpu-0-mig-1g10gb-me-3"]
    assert (row["PROFILE"], row["PLACEMENT"]) == ("1g.10gb+me", "3+1")


def test_table_health_from_the_plugins_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from driver.devices.model import build_pool
    from driver.health.store import HealthStore
    from driver.nvml.selection import select_backend

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


def test_table_health_has_the_recovery_actions_of_the_running_plugin(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, short_dir: Path
) -> None:
    """A recovery action that taints a GPU (NoSchedule on every device of it) is known
    only to the running plugin: inventory asks its /status, as `gpu-dra status` does,
    and shows the GPU unhealthy as status, the metric and the health stream do."""
    from driver.health.recovery_taints import RecoveryFailure
    from driver.nvml.selection import select_backend
    from driver.observability.status_socket import StatusSocketServer

    gpus = select_backend(mock=True, node_name="n1").discover().gpus
    failure = RecoveryFailure(gpus[6].uuid, 2, "2026-01-01T00:00:00Z")  # node-reboot
    document = {
        "gpus": [
            {"uuid": g.uuid, "failures": [failure.to_json("gpu.example.com")] if i == 6 else []}
            for i, g in enumerate(gpus)
        ]
    }
    path = short_dir / "status.sock"
    argv = ("--mock", "--node-name", "n1", "--state-dir", str(tmp_path))
    with StatusSocketServer(path, lambda: document, lambda: (True, "ok\n")).start():
        code, out, _ = run(capsys, *argv, "--socket", str(path), "--partitions")
    assert code == 0
    unhealthy = "Unhealthy (gpu.example.com/recovery-action=node-reboot:NoSchedule)"
    rows = {r["DEVICE"]: r["HEALTH"] for r in table(out)}
    family = [name for name in rows if name == "gpu-6" or name.startswith("gpu-6-")]
    assert len(family) > 1 and all(rows[name] == unhealthy for name in family)
    assert all(h == "Healthy" for name, h in rows.items() if name not in family)
    assert f"recovery actions from the plugin at {path}" in out

    # Without the plugin, the recovery actions are not known, and inventory says so.
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "recovery actions unknown: the plugin does not answer" in out


def test_table_health_shows_the_effect_the_plugin_publishes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from driver.health.store import HealthStore
    from driver.nvml.selection import select_backend

    gpus = select_backend(mock=True, node_name="n1").discover().gpus
    HealthStore(tmp_path / "health.json").record_xid(gpus[3].uuid, 79)
    argv = ("--mock", "--node-name", "n1", "--state-dir", str(tmp_path))

    monkeypatch.setenv("XID_TAINT_EFFECT", "NoExecute")  # as in the plugin's pod
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert table(out)[3]["HEALTH"] == "Unhealthy (gpu.example.com/xid=79:NoExecute)"
    code, out, _ = run(capsys, *argv, "--xid-taint-effect", "None")
    assert table(out)[3]["HEALTH"] == "Unhealthy (gpu.example.com/xid=79:None)"
    assert table(out)[2]["HEALTH"] == "Healthy"

    monkeypatch.setenv("XID_TAINT_EFFECT", "Sometimes")
    code, out, err = run(capsys, *argv)
    assert (code, out) == (1, "")
    assert "--xid-taint-effect (env XID_TAINT_EFFECT): 'Sometimes' is not one of" in err


def test_static_mig_gpus_without_mig_devices_are_rows_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Nothing of such a GPU is published; the table still lists it, with its health."""
    from driver.health.store import HealthStore
    from driver.nvml.selection import select_backend

    gpus = select_backend(mock=True, node_name="n1").discover().gpus
    HealthStore(tmp_path / "health.json").record_xid(gpus[1].uuid, 48)
    code, out, _ = run(
        capsys, "--mock", "--node-name", "n1", "--mig-strategy", "static",
        "--state-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0
    rows = table(out)
    assert [r["UUID"] for r in rows] == [g.uuid for g in gpus]
    assert {(r["DEVICE"], r["MIG"], r["PARTITIONS"]) for r in rows} == {("-", "static", "0")}
    assert rows[1]["HEALTH"] == "Unhealthy (gpu.example.com/xid=48:NoSchedule)"
    assert rows[0]["HEALTH"] == "Healthy"
    assert "8 GPU(s), 0 device(s)" in out


def test_table_columns_each_mean_one_thing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """INDEX, PCI BUS ID are the GPU's on every row; UUID is the row's own device;
    PARTITIONS counts published partitions on GPU rows only; PROFILE and PLACEMENT
    are the MIG device a row is delivered as."""
    from driver.nvml.selection import select_backend

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "gpus:\n"
        "- model: H100-80GB\n"
        "  count: 1\n"
        "  migInstances: [{profile: 1g.10gb, start: 0}, {profile: 3g.40gb, start: 4}]\n"
        "- model: H100-80GB\n"
        "  count: 1\n"
        "- model: A100-40GB\n"
        "  count: 1\n"
        "  migMode: disabled\n"
    )
    inventory = select_backend(mock=True, fleet_path=fleet, node_name="n1").discover()
    code, out, _ = run(capsys, "--mock", str(fleet), "--node-name", "n1", "--partitions")
    assert code == 0
    rows = table(out)
    by_device = {r["DEVICE"]: r for r in rows}
    static_gpu, dynamic_gpu, plain_gpu = inventory.gpus

    # GPU 0, static: no whole-GPU device, two existing MIG devices.
    assert rows[0]["DEVICE"] == "-" and rows[0]["UUID"] == static_gpu.uuid
    assert (rows[0]["MIG"], rows[0]["PARTITIONS"]) == ("static", "2")
    mig_uuids = {i.placement: i.uuid for i in static_gpu.mig_instances}
    small = by_device["gpu-0-mig-1g10gb-0"]
    assert (small["UUID"], small["PROFILE"], small["PLACEMENT"]) == (
        mig_uuids[(0, 1)], "1g.10gb", "0+1",
    )  # fmt: skip
    assert (small["INDEX"], small["PCI BUS ID"]) == ("0", static_gpu.pci_bus_id)
    assert small["PARTITIONS"] == "-"

    # GPU 1, dynamic: the whole GPU is a full-size MIG device; partitions have no UUID yet.
    whole = by_device["gpu-1"]
    assert (whole["UUID"], whole["MIG"], whole["PROFILE"], whole["PLACEMENT"]) == (
        dynamic_gpu.uuid, "dynamic", "7g.80gb", "0+8",
    )  # fmt: skip
    partitions = [r for r in rows if r["DEVICE"].startswith("gpu-1-")]
    assert whole["PARTITIONS"] == str(len(partitions))
    assert {(r["UUID"], r["INDEX"], r["PCI BUS ID"]) for r in partitions} == {
        ("-", "1", dynamic_gpu.pci_bus_id)
    }

    # GPU 2: MIG-capable, MIG mode off.
    plain = by_device["gpu-2"]
    assert (plain["UUID"], plain["MIG"], plain["PROFILE"], plain["PLACEMENT"]) == (
        plain_gpu.uuid, "disabled", "-", "-",
    )  # fmt: skip
    assert plain["PARTITIONS"] == "0"


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`gpu-dra inventory | head` (every subcommand: the CLI's entry point)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from driver.cli import main; sys.exit(main())",
         "inventory", "--mock", "--node-name", "n1", "-o", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == b"{\n"
    proc.stdout.close()  # more than a pipe's buffer is still to come
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


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
    assert main(["inventory", "--mock", "--gpu-partitions", "-1"]) == 1  # as in the plugin
    assert "--gpu-partitions (env GPU_PARTITIONS): must be >= 0" in capsys.readouterr().err


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


def test_the_sharing_column_says_where_mps_limits_shares_and_partitions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text('{"gpus": [{"model": "A100-40GB", "count": 2, "migMode": "disabled"}]}')
    mock = ("--mock", str(fleet), "--node-name", "n1", "--mps-daemons", "node")
    code, out, err = run(capsys, *mock, "--gpu-allow-multiple-allocations")
    assert code == 0, err
    assert table(out)[0]["SHARING"] == (
        "shares: compute step 1, memory step 1Gi, MPS limits per process (cooperative)"
    )
    code, out, err = run(capsys, *mock, "--gpu-partitions", "2", "--partitions")
    assert code == 0, err
    rows = {r["DEVICE"]: r["SHARING"] for r in table(out)}
    assert rows["gpu-0-partition-1"] == "exclusive, MPS limits per process (cooperative)"
    # A whole GPU no share divides: its one daemon holds it in EXCLUSIVE_PROCESS.
    assert rows["gpu-0-full"] == "exclusive, MPS strict (EXCLUSIVE_PROCESS)"
    code, out, err = run(capsys, *mock[:-2], "--gpu-allow-multiple-allocations")
    assert table(out)[0]["SHARING"] == "shares: compute step 1, memory step 1Gi"
    assert "MPS limits" not in out


def test_the_table_says_what_mps_limits_do_not_hold(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Under the table, where devices carry `mpsIsolation`, what the MPS limits are:
    per process, cooperative, one server's clients share faults, servers are
    time-sliced, 48 clients per server, memory overcommitted by the servers' contexts."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text('{"gpus": [{"model": "A100-40GB", "migMode": "disabled"}]}')
    mock = ("--mock", str(fleet), "--node-name", "n1", "--gpu-allow-multiple-allocations")
    code, out, err = run(capsys, *mock, "--mps-daemons", "node")
    assert code == 0, err
    note = out[out.index("MPS limits (mpsIsolation: cooperative") :]
    for words in (
        "per CUDA process, not per claim",
        "CUDA_MPS_PIPE_DIRECTORY elsewhere runs outside MPS, unlimited",
        "a fatal fault in one process can end the other processes of the same claim",
        "time-sliced",
        "48 client processes per server",
        "overcommit",
        "docs/mps.md",
    ):
        assert words in note, words
    assert "enforce" not in out
    code, out, err = run(capsys, *mock)
    assert code == 0, err
    assert "mpsIsolation" not in out
