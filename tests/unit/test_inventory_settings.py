"""`gpu-dra inventory` reads the plugin's settings (one settings module): in the plugin's
pod, `kubectl exec <pod> -- gpu-dra inventory` shows what the plugin publishes, the MIG
devices the plugin created for prepared claims included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli import main
from driver.devices.model import MigStrategy
from tests.unit.test_mig_foreign import _target
from tests.unit.test_mig_prepare import H100, NODE, make_node

# The plugin pod's environment (the chart's names), and what the CLI reads besides.
POD_ENV = (
    "NODE_NAME",
    "DRIVER_NAME",
    "NVML_BACKEND",
    "MOCK_FLEET",
    "MOCK_DRIVER_ROOT",
    "GPU_PARTITIONS",
    "MIG_STRATEGY",
    "GPU_ALLOW_MULTIPLE_ALLOCATIONS",
    "XID_TAINT_EFFECT",
    "KUBELET_PLUGINS_DIRECTORY_PATH",
    "NVIDIA_DRIVER_ROOT",
    "MPS_DAEMONS",
)


@pytest.fixture(autouse=True)
def plugin_pod_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in POD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPU_DRA_STATE_DIR", str(tmp_path / "no-plugin-here"))


def inventory(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main(["inventory", "-o", "json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def devices(listing: Any) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in listing["items"] for d in s["spec"].get("devices") or []}


def test_in_a_mock_plugin_pod_inventory_shows_what_the_plugin_publishes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "NODE_NAME": "worker-1",
        "DRIVER_NAME": "gpu.acme.io",
        "NVML_BACKEND": "mock",
        "MOCK_FLEET": "example",
        "GPU_PARTITIONS": "2",
        "GPU_ALLOW_MULTIPLE_ALLOCATIONS": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, listing, err = inventory(capsys)
    assert code == 0, err  # before: "NVML is not available" without --mock
    first = listing["items"][0]
    assert first["spec"]["driver"] == "gpu.acme.io"
    assert first["spec"]["nodeName"] == "worker-1"
    published = devices(listing)
    assert "gpu-0-partition-1" in published and "gpu-0-full" in published
    assert all(d["allowMultipleAllocations"] is True for d in published.values())


@pytest.mark.parametrize(
    ("fleet", "env", "flags"),
    [
        ("default", {"MIG_STRATEGY": "static"}, ["--mig-strategy", "static"]),
        ("default", {"GPU_PARTITIONS": "3"}, ["--gpu-partitions", "3"]),
        ("example", {"GPU_ALLOW_MULTIPLE_ALLOCATIONS": "1"}, ["--gpu-allow-multiple-allocations"]),
        ("default", {"DRIVER_NAME": "gpu.other.org"}, ["--driver-name", "gpu.other.org"]),
        ("", {"MOCK_FLEET": "example"}, ["--mock-fleet", "example"]),
    ],
)
def test_each_setting_from_the_environment_is_its_flag(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fleet: str,
    env: dict[str, str],
    flags: list[str],
) -> None:
    base = ("--mock", fleet, "--node-name", "n1")
    default = inventory(capsys, *base)[:2]
    by_flag = inventory(capsys, *base, *flags)[:2]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    by_env = inventory(capsys, *base)[:2]
    assert by_env == by_flag != default


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MIG_STRATEGY": "dynamc"}, "--mig-strategy (env MIG_STRATEGY): 'dynamc' is not one"),
        (
            {"GPU_ALLOW_MULTIPLE_ALLOCATIONS": "maybe"},
            "--gpu-allow-multiple-allocations (env GPU_ALLOW_MULTIPLE_ALLOCATIONS): 'maybe'",
        ),
        ({"DRIVER_NAME": "../../tmp/x"}, "--driver-name (env DRIVER_NAME): '../../tmp/x'"),
        ({"GPU_PARTITIONS": "-1"}, "--gpu-partitions (env GPU_PARTITIONS): must be >= 0"),
    ],
)
def test_a_bad_setting_is_one_line_as_in_the_plugin(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = inventory(capsys, "--mock", "--node-name", "n1")
    assert code == 1
    assert err.count("\n") == 1 and err.startswith(f"gpu-dra inventory: {message}"), err


def test_the_plugin_and_inventory_read_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from driver.cli import build_parser
    from driver.cli.inventory import read_inventory_settings
    from driver.plugin.options.flags import parse_options
    from driver.plugin.options.settings import NodeSettings

    env = {
        "NODE_NAME": "n1",
        "DRIVER_NAME": "gpu.acme.io",
        "NVML_BACKEND": "mock",
        "MOCK_FLEET": "example",
        "MOCK_DRIVER_ROOT": "/var/lib/gpu-dra/mock",
        "GPU_PARTITIONS": "4",
        "MIG_STRATEGY": "static",
        "GPU_ALLOW_MULTIPLE_ALLOCATIONS": "yes",
        "XID_TAINT_EFFECT": "NoExecute",
        "KUBELET_PLUGINS_DIRECTORY_PATH": "/var/lib/k/plugins",
        "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugin = parse_options([])
    cli = read_inventory_settings(build_parser().parse_args(["inventory"]))
    fields = NodeSettings.__dataclass_fields__
    assert {f: getattr(cli, f) for f in fields} == {f: getattr(plugin, f) for f in fields}
    assert cli.mig_strategy is MigStrategy.STATIC and cli.gpu_partitions == 4


def test_the_journals_own_mig_devices_are_published_as_the_plugin_does(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A MIG device the plugin created for a prepared claim is not foreign: the GPU
    stays dynamic under `auto`. Without the journal, inventory took the GPU for an
    administrator's static one and showed a single device."""
    node = make_node(tmp_path, H100, MigStrategy.DYNAMIC)
    ref = node.claims.add("mine", "gpu-0-mig-1g10gb-3")
    assert node.state.prepare([ref])["mine"].ok
    plugin = make_node(tmp_path, H100, MigStrategy.AUTO)  # what a restarted plugin publishes
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(H100))
    env = {
        "NODE_NAME": NODE,
        "NVML_BACKEND": "mock",
        "MOCK_FLEET": str(fleet),
        "MOCK_DRIVER_ROOT": str(tmp_path / "driver-root"),
        "GPU_DRA_STATE_DIR": str(tmp_path / "plugin"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, listing, err = inventory(capsys)
    assert code == 0, err
    assert list(devices(listing)) == [d.name for d in plugin.pool.devices]
    assert "gpu-0" in devices(listing)  # dynamic: the whole GPU and every placement


def test_a_fleet_named_on_the_command_line_is_not_mixed_with_the_plugins_mig_state(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`inventory --mock FLEET` shows what that fleet would publish: the running plugin's
    mock MIG state (here a MIG device an administrator made, which turns the plugin's
    GPU static) belongs to the plugin's fleet, not to the file's."""
    node = make_node(tmp_path, H100)
    node.backend.mig().create(_target(node, "gpu-0-mig-1g10gb-3"))
    state_dir = tmp_path / "plugin"
    (tmp_path / "driver-root").rename(state_dir / "mock-driver-root")
    monkeypatch.setenv("GPU_DRA_STATE_DIR", str(state_dir))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(H100))

    code, plugins_view, err = inventory(capsys, "--mock", "--node-name", NODE)
    assert code == 0, err
    assert "gpu-0" not in devices(plugins_view)  # the plugin's: static, its one device

    code, listing, err = inventory(capsys, "--mock", str(fleet), "--node-name", NODE)
    assert code == 0, err
    assert "gpu-0" in devices(listing)  # the file's fleet, fresh: dynamic, the whole GPU


def test_inventory_marks_the_devices_mps_limits_where_the_plugin_runs_mps_daemons(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MPS_DAEMONS (the chart's kubeletPlugin.mps.enabled) is a node setting: the GPUs
    with MIG off publish `mpsIsolation` (`"strict"` on a whole GPU no share divides),
    MIG devices do not, and no device publishes the former `mps` attribute."""
    fleet = str(tmp_path / "fleet.yaml")
    Path(fleet).write_text(
        yaml.safe_dump(
            {"gpus": [{"model": "A100-40GB", "migMode": "disabled"}, {"model": "H100-80GB"}]}
        )
    )
    monkeypatch.setenv("MPS_DAEMONS", "kubernetes")
    code, listing, err = inventory(capsys, "--mock", fleet, "--node-name", "n1")
    assert code == 0, err
    marked = {n: d["attributes"].get("mpsIsolation") for n, d in devices(listing).items()}
    assert {n: v for n, v in marked.items() if v} == {"gpu-0": {"string": "strict"}}
    assert not any("mps" in d["attributes"] for d in devices(listing).values())
    code, listing, err = inventory(
        capsys, "--mock", fleet, "--node-name", "n1", "--mps-daemons", "off"
    )
    assert code == 0, err
    assert not any(
        {"mps", "mpsIsolation"} & d["attributes"].keys() for d in devices(listing).values()
    )
