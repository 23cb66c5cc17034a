"""gpu-kubelet-plugin: configuration errors end in one line, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.plugin import main as plugin_main


def test_bad_fleet_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("gpus:\n- model: A100-40GB\n  colour: green\n")
    code = plugin_main.main(
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
    assert code == 1
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("gpu-kubelet-plugin: ")]
    assert len(lines) == 1 and "colour: unknown field" in lines[0]


def test_bad_permanent_errors_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = plugin_main.main(
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
    assert code == 1 and "Traceback" not in err
    assert err.count("gpu-kubelet-plugin: ") == 1


@pytest.mark.parametrize(
    ("entry", "prog"),
    [
        ("driver.plugin.flags:build_parser", "gpu-kubelet-plugin"),
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
    from driver.plugin.flags import build_parser

    monkeypatch.delenv("MIG_STRATEGY", raising=False)
    text = " ".join(build_parser().format_help().split())
    assert "--mig-strategy {auto,dynamic,static}" in text
    assert "(env MIG_STRATEGY, default: auto)" in text
    assert "(env KUBELET_PLUGINS_DIRECTORY_PATH, default: /var/lib/kubelet/plugins)" in text
    assert "(env V, default: 0)" in text
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "version"):
            assert action.help and "(env " in action.help and "default: " in action.help


def test_webhook_verbosity() -> None:
    from driver.webhook.main import build_parser, log_level

    base = ["--tls-cert-file", "c", "--tls-private-key-file", "k"]
    assert log_level(build_parser().parse_args(base)) == "INFO"
    assert log_level(build_parser().parse_args([*base, "-v", "2"])) == "DEBUG"
    assert log_level(build_parser().parse_args([*base, "--v", "0"])) == "INFO"
