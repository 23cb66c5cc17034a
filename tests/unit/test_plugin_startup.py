"""gpu-kubelet-plugin start-up: every bad setting, from a flag or its environment
variable, ends in one line and exit code 1 before anything touches the host; an HTTP
port that cannot be bound is found before the kubelet's sockets are served."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.plugin import main as plugin_main
from driver.plugin.options.flags import build_parser

PLUGIN_ENV = {
    action.option_strings[-1].lstrip("-").upper().replace("-", "_")
    for action in build_parser()._actions
    if action.option_strings and action.dest not in ("help", "version")
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    # The plugin's logging writes to this test's captured stderr: not to later tests'.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def plugin_args(tmp_path: Path, *flags: str) -> list[str]:
    """Flags for a mock plugin whose host directories are under `tmp_path/host`."""
    host = tmp_path / "host"
    return [
        "--node-name=n1",
        "--nvml-backend=mock",
        f"--kubelet-plugins-directory-path={host / 'plugins'}",
        f"--kubelet-registrar-directory-path={host / 'registry'}",
        f"--cdi-root={host / 'cdi'}",
        *flags,
    ]


def created(tmp_path: Path) -> list[str]:
    host = tmp_path / "host"
    return sorted(str(p.relative_to(host)) for p in host.rglob("*")) if host.exists() else []


def run_plugin_to_exit(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The plugin started with `flags` and a kubeconfig, none of its settings taken from
    this environment, run until it exits."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig")
    argv = plugin_args(tmp_path, *flags, f"--kubeconfig={kubeconfig}")
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "driver.plugin.main", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def one_line_error(err: str) -> str:
    assert "Traceback" not in err and "usage:" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("gpu-kubelet-plugin: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "env", "named"),
    [
        (["--mig-strategy=dynamc"], {}, "--mig-strategy (env MIG_STRATEGY): 'dynamc' is not one"),
        ([], {"MIG_STRATEGY": "Static"}, "--mig-strategy (env MIG_STRATEGY): 'Static'"),
        (["--nvml-backend=cuda"], {}, "--nvml-backend (env NVML_BACKEND): 'cuda'"),
        (["--log-format=xml"], {}, "--log-format (env LOG_FORMAT): 'xml'"),
        (["--xid-taint-effect=Evict"], {}, "--xid-taint-effect (env XID_TAINT_EFFECT): 'Evict'"),
        (["--http-port=99999"], {}, "--http-port (env HTTP_PORT): must be <= 65535"),
        ([], {"HTTP_PORT": "http"}, "--http-port (env HTTP_PORT): 'http' is not an integer"),
        ([], {"DEVICE_STATUS": "maybe"}, "--device-status (env DEVICE_STATUS): 'maybe' is not"),
        (
            [],
            {"GPU_ALLOW_MULTIPLE_ALLOCATIONS": "maybe"},
            "--gpu-allow-multiple-allocations (env GPU_ALLOW_MULTIPLE_ALLOCATIONS): 'maybe'",
        ),
        ([], {"V": "-1"}, "--v (env V): must be >= 0, got -1"),
        (["-v", "-1"], {}, "--v (env V): must be >= 0"),
        ([], {"GPU_PARTITIONS": "-2"}, "--gpu-partitions (env GPU_PARTITIONS): must be >= 0"),
        (["--fatal-xids=79,x"], {}, "--fatal-xids (env FATAL_XIDS): 'x' is not an Xid"),
        ([], {"PERMANENT_ERRORS": "transient"}, "--permanent-errors (env PERMANENT_ERRORS)"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_1_before_the_host_is_touched(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    env: dict[str, str],
    named: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "HTTP_PORT" not in env and not any(f.startswith("--http-port") for f in flags):
        flags = ["--http-port=-1", *flags]
    with pytest.raises(SystemExit) as exc:
        plugin_main.main(plugin_args(tmp_path, *flags))
    assert exc.value.code == 1
    assert named in one_line_error(capsys.readouterr().err)
    assert created(tmp_path) == []


@pytest.mark.parametrize(
    ("env", "attribute", "value"),
    [
        ({"DEVICE_STATUS": "True"}, "device_status", True),
        ({"DEVICE_STATUS": "0"}, "device_status", False),
        ({"GPU_ALLOW_MULTIPLE_ALLOCATIONS": "yes"}, "allow_multiple_allocations", True),
        ({"PERMANENT_ERRORS": ""}, "permanent_errors", ""),  # no class is permanent
        ({"HTTP_PORT": "-1"}, "http_port", -1),
        ({"XID_TAINT_EFFECT": "none"}, "xid_taint_effect", "None"),
    ],
)
def test_good_values_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], attribute: str, value: object
) -> None:
    from driver.plugin.options.flags import parse_options

    for name, text in env.items():
        monkeypatch.setenv(name, text)
    assert getattr(parse_options(["--node-name=n"]), attribute) == value


def test_a_switch_takes_a_value_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from driver.plugin.options.flags import parse_options

    monkeypatch.setenv("DEVICE_STATUS", "true")
    assert parse_options(["--node-name=n", "--device-status=false"]).device_status is False
    assert parse_options(["--node-name=n", "--device-status"]).device_status is True


def test_a_bad_kubeconfig_leaves_nothing_on_the_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = plugin_main.main(
        plugin_args(tmp_path, "--http-port=-1", f"--kubeconfig={tmp_path / 'absent'}")
    )
    assert code == 1
    assert "kubeconfig" in one_line_error(capsys.readouterr().err)
    assert created(tmp_path) == []  # no data dir, no instances.lock, no CDI root


def write_kubeconfig(path: Path) -> Path:
    """A kubeconfig of an API server that is not there (nothing ever connects)."""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:9', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("", 0)) as listener:
        yield int(listener.getsockname()[1])


def test_a_busy_http_port_fails_before_the_sockets_are_served(
    tmp_path: Path, busy_port: int
) -> None:
    proc = run_plugin_to_exit(tmp_path, f"--http-port={busy_port}")
    assert proc.returncode == 1, proc.stderr
    assert f"--http-port {busy_port}: cannot listen" in one_line_error(proc.stderr)
    assert created(tmp_path) == []  # no stale sockets in the kubelet's directories


def test_every_flag_has_its_own_help_and_names_its_variable_once() -> None:
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        env = action.option_strings[-1].lstrip("-").upper().replace("-", "_")
        assert action.help, action.option_strings
        description = action.help.split(f"(env {env}, default:")[0].strip()
        assert description, f"{action.option_strings[-1]} has no description"
        assert action.help.count(env) == 1, action.help


def test_help_shows_choices_and_daemon_defaults() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--mig-strategy {auto,dynamic,static}" in text
    assert "(env MIG_STRATEGY, default: auto)" in text
    assert "(env V, default: 2)" in text
    assert "(env HTTP_PORT, default: 8080)" in text


def test_a_foreign_mig_device_under_dynamic_is_named_by_its_profile(tmp_path: Path) -> None:
    from driver.devices.model import MigStrategy, PoolError, PoolOptions, build_pool
    from driver.nvml.selection import select_backend

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "gpus:\n- model: H100-80GB\n  count: 1\n"
        "  migInstances: [{profile: 1g.10gb, start: 3}, {profile: 3g.40gb, start: 4}]\n"
    )
    inventory = select_backend(mock=True, fleet_path=fleet, node_name="n1").discover()
    with pytest.raises(PoolError) as exc:
        build_pool(inventory, PoolOptions(mig_strategy=MigStrategy.DYNAMIC))
    message = str(exc.value)
    assert "GPU instance 10 (1g.10gb at 3+1)" in message, message
    assert "(3g.40gb at 4+4)" in message, message
    assert "profile 19" not in message


@dataclass(frozen=True)
class Report:
    """Shaped like the journal's start-up recovery report."""

    swept_temp_files: tuple[Path, ...] = ()
    rolled_back: tuple[str, ...] = ()
    checkpoint_problem: str | None = None


def test_the_start_up_recovery_is_logged_as_text_not_a_repr() -> None:
    from driver.plugin.plugin_status import describe_recovery

    assert describe_recovery(Report()) == "nothing to do"
    text = describe_recovery(Report(rolled_back=("uid-1", "uid-2"), checkpoint_problem="bad"))
    assert text == "rolled back: 2 (uid-1, uid-2); checkpoint problem: bad"


def test_healthz_before_the_first_sync_says_so() -> None:
    from driver.plugin.plugin_status import health_report

    ok, text = health_report(registered=False, last_synced=0.0, checkpoint_problem=None)
    assert ok and text == "ok: not registered, slices not synced yet\n"


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_planted_claim_lock_stops_the_start_with_one_line_naming_it(
    tmp_path: Path, planted: str
) -> None:
    """Before: a symlink or FIFO named inflight-<uid>.lock in the data directory ended
    every start in a traceback (issue 34, item 10)."""
    data_dir = tmp_path / "host" / "plugins" / "gpu.example.com"
    data_dir.mkdir(parents=True)
    lock = data_dir / "inflight-0b1c.lock"
    if planted == "symlink":
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(lock)
    proc = run_plugin_to_exit(tmp_path, "--http-port=-1")
    assert proc.returncode == 1, proc.stderr
    line = one_line_error(proc.stderr)
    assert str(lock) in line and "remove it" in line, line
    assert not (tmp_path / "elsewhere").exists()
