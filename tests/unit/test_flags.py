"""gpu-kubelet-plugin: configuration errors end in one line, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.plugin import main as plugin_main

# The plugin's logging writes to this test's captured stderr: not to later tests'.
pytestmark = pytest.mark.usefixtures("restore_logging")


def test_bad_fleet_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("gpus:\n- model: A100-40GB\n  colour: green\n")
    with pytest.raises(SystemExit) as exc:  # checked with the other settings
        plugin_main.main(
            [
                "--node-name",
                "n1",
                "--nvml-backend",
                "mock",
                "--mock-fleet",
                str(fleet),
                "--kubelet-plugins-directory-path",
                str(tmp_path / "plugins"),
                "--cdi-root",
                str(tmp_path / "cdi"),
                "--http-port",
                "-1",
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("gpu-kubelet-plugin: ")]
    assert len(lines) == 1 and "colour: unknown field" in lines[0]
    assert "--mock-fleet (env MOCK_FLEET)" in lines[0]
    assert not (tmp_path / "plugins").exists()


def test_bad_permanent_errors_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        plugin_main.main(
            [
                "--node-name",
                "n1",
                "--nvml-backend",
                "mock",
                "--permanent-errors",
                "no-such-class",
                "--kubelet-plugins-directory-path",
                str(tmp_path / "plugins"),
                "--cdi-root",
                str(tmp_path / "cdi"),
                "--http-port",
                "-1",
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err
    assert err.count("gpu-kubelet-plugin: ") == 1


@pytest.mark.parametrize(
    ("entry", "prog"),
    [
        ("driver.plugin.options.flags:build_parser", "gpu-kubelet-plugin"),
        ("driver.webhook.main:build_parser", "gpu-dra-webhook"),
        ("driver.cli:build_parser", "gpu-dra"),
    ],
)
def test_version_flag(entry: str, prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib
    from importlib.metadata import version

    module, name = entry.split(":")
    parser = getattr(importlib.import_module(module), name)()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"{prog} {version('gpu-dra-driver')}\n"


def test_every_plugin_flag_help_shows_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from driver.plugin.options.flags import build_parser

    monkeypatch.delenv("MIG_STRATEGY", raising=False)
    text = " ".join(build_parser().format_help().split())
    assert "--mig-strategy {auto,dynamic,static}" in text
    assert "(env MIG_STRATEGY, default: auto)" in text
    assert "(env KUBELET_PLUGINS_DIRECTORY_PATH, default: /var/lib/kubelet/plugins)" in text
    assert "(env V, default: 2)" in text
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "version"):
            assert action.help and "(env " in action.help and "default: " in action.help


# -- values that reach the host's filesystem -----------------------------------------


def run_plugin(tmp_path: Path, *flags: str) -> int:
    """The plugin with `flags` on top of directories under `tmp_path` (not created)."""
    return plugin_main.main(
        [
            "--node-name",
            "n1",
            "--nvml-backend",
            "mock",
            "--kubelet-plugins-directory-path",
            str(tmp_path / "plugins"),
            "--kubelet-registrar-directory-path",
            str(tmp_path / "registry"),
            "--cdi-root",
            str(tmp_path / "cdi"),
            "--kubeconfig",
            str(tmp_path / "no-kubeconfig"),
            "--http-port",
            "-1",
            *flags,
        ]
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--driver-name", "../../../evil"], "--driver-name (env DRIVER_NAME): '../../../evil'"),
        (["--driver-name", "GPU.example.com"], "is not a DNS subdomain"),
        (["--driver-name", ""], "--driver-name (env DRIVER_NAME): '' is not a DNS subdomain"),
        (["--driver-name", "a" * 64], "longer than 63 characters"),
        (["--cdi-root", "cdi"], "--cdi-root (env CDI_ROOT): 'cdi' is not an absolute path"),
        (["--cdi-root", "/var/run/../../etc"], "--cdi-root (env CDI_ROOT): '/var/run/../../etc'"),
        (["--cdi-root", "/etc"], "'/etc' is a system directory"),
        (["--cdi-root", "/"], "--cdi-root (env CDI_ROOT): '/' is a system directory"),
        (["--cdi-root", "/proc/self/cwd"], "'/proc/self/cwd' is a system directory"),
        (["--kubelet-plugins-directory-path", "/usr"], "--kubelet-plugins-directory-path (env"),
        (["--kubelet-registrar-directory-path", "/sys/x"], "--kubelet-registrar-directory-path"),
        (["--mock-driver-root", "//mock"], "--mock-driver-root (env MOCK_DRIVER_ROOT): '//mock'"),
        (["--nvidia-driver-root", "run/nvidia/driver"], "--nvidia-driver-root (env"),
        (["--nvidia-driver-root-host", "/x/../y"], "--nvidia-driver-root-host (env"),
        (["--nvidia-cdi-hook-path", "bin/nvidia-cdi-hook"], "--nvidia-cdi-hook-path (env"),
    ],
)
def test_host_paths_and_driver_name_are_checked_before_the_host_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        run_plugin(tmp_path, *flags)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err and "usage:" not in err
    assert err.count("\n") == 1 and err.startswith("gpu-kubelet-plugin: ")
    assert named in err
    assert list(tmp_path.iterdir()) == []  # nothing created: no data dir, no CDI root


def test_env_values_are_checked_like_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRIVER_NAME", "x/../../tmp")
    with pytest.raises(SystemExit) as exc:
        run_plugin(tmp_path)
    assert exc.value.code == 1
    assert "--driver-name (env DRIVER_NAME): 'x/../../tmp'" in capsys.readouterr().err


def test_usual_values_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from driver.plugin.options.flags import parse_options

    for name in ("DRIVER_NAME", "CDI_ROOT", "NVIDIA_DRIVER_ROOT", "NVIDIA_CDI_HOOK_PATH"):
        monkeypatch.delenv(name, raising=False)
    options = parse_options(
        [
            "--node-name=n",
            "--cdi-root=/etc/cdi",
            "--nvidia-driver-root=/",
            "--nvidia-driver-root-host=/run/nvidia/driver",
            "--nvidia-cdi-hook-path=/usr/local/bin/nvidia-cdi-hook",
            "--driver-name=gpu.example-1.com",
            "--mock-driver-root=/var/lib/gpu-dra/mock",
        ]
    )
    assert options.data_dir == Path("/var/lib/kubelet/plugins/gpu.example-1.com")
    assert parse_options(["--node-name=n", "--cdi-root=/var/run/cdi/"]).cdi_root == Path(
        "/var/run/cdi"
    )


@pytest.mark.parametrize("argv", [["health"], ["journal", "show"]])
def test_cli_refuses_a_driver_name_that_is_a_path(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from driver.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--driver-name", "../../../tmp/evil"])
    assert exc.value.code == 2
    assert "argument --driver-name: '../../../tmp/evil' is not a DNS subdomain" in (
        capsys.readouterr().err
    )


def test_webhook_refuses_a_driver_name_that_is_a_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from driver.webhook.main import build_parser

    base = ["--tls-cert-file", "c", "--tls-private-key-file", "k"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--driver-name", "Evil/../x"])
    assert "argument --driver-name: 'Evil/../x' is not a DNS subdomain" in (capsys.readouterr().err)
