"""`-v` on gpu-dra (every subcommand), one verbosity scale for the three binaries;
gpu-dra-webhook's flags from the environment, each with its environment variable and
default in --help."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from driver import cli
from driver.cli.verbosity import configure_logging
from driver.observability.logs import setup_logging
from driver.plugin.options.flags import parse_options
from driver.webhook import main as webhook_main

CLIENT_LOGGERS = ("urllib3",)

WEBHOOK_ENV = ("TLS_CERT_FILE", "TLS_PRIVATE_KEY_FILE", "PORT", "BIND_ADDRESS", "DRIVER_NAME")
WEBHOOK_ENV_ALL = (*WEBHOOK_ENV, "LOG_LEVEL", "V")


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    names = ["", *CLIENT_LOGGERS]
    levels = {name: logging.getLogger(name).level for name in names}
    handlers = logging.getLogger().handlers[:]
    for name in WEBHOOK_ENV_ALL:
        monkeypatch.delenv(name, raising=False)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


def subcommand_parsers(
    parser: argparse.ArgumentParser, path: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand's parser by its command line, e.g. "health clear"."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{path} {name}".strip()] = sub
                found.update(subcommand_parsers(sub, f"{path} {name}".strip()))
    return found


def test_every_subcommand_takes_v() -> None:
    parsers = subcommand_parsers(cli.build_parser())
    assert {"inventory", "validate", "health", "health clear", "journal show", "mock xid"} <= set(
        parsers
    )
    for path, parser in parsers.items():
        options = {s for a in parser._actions for s in a.option_strings}
        assert {"-v", "--v"} <= options, path


def run_validate(tmp_path: Path, flags: list[str]) -> int:
    """`gpu-dra <flags> FILE` with "@" in `flags` standing for the subcommand."""
    document = tmp_path / "config.yaml"
    document.write_text(
        "apiVersion: gpu.resource.example.com/v1alpha1\nkind: GpuConfig\n"
        "sharing: {strategy: TimeSlicing}\n"
    )
    argv = ["validate" if flag == "@" else flag for flag in flags]
    return cli.main([*argv, str(document)])


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (["@"], logging.WARNING),
        (["-v", "1", "@"], logging.INFO),
        (["--v", "3", "@"], logging.INFO),
        (["--v=4", "@"], logging.DEBUG),
        (["@", "-v", "2"], logging.INFO),
        (["-v", "5", "@", "-v", "0"], logging.WARNING),
        (["-v", "9", "@"], logging.DEBUG),
    ],
    ids=["default", "v1", "v3", "v4", "after-subcommand", "subcommand-wins", "v9"],
)
def test_verbosity_sets_the_log_level(tmp_path: Path, flags: list[str], level: int) -> None:
    assert run_validate(tmp_path, flags) == 0
    assert logging.getLogger().level == level
    # Bearer tokens in the Kubernetes client's debug logs.


def plugin_level(verbosity: str | None) -> int:
    argv = ["--node-name=n"] + ([f"--v={verbosity}"] if verbosity is not None else [])
    options = parse_options(argv)
    setup_logging(options.log_format, options.verbosity)
    return logging.getLogger().level


def webhook_level(verbosity: str | None) -> int:
    argv = ["--tls-cert-file=c", "--tls-private-key-file=k"]
    argv += [f"--v={verbosity}"] if verbosity is not None else []
    webhook_main.configure_logging(webhook_main.parse_args(argv))
    return logging.getLogger().level


def cli_level(verbosity: str | None) -> int:
    configure_logging(int(verbosity or 0))
    return logging.getLogger().level


SCALE = {
    "0": logging.WARNING,
    "1": logging.INFO,
    "2": logging.INFO,
    "3": logging.INFO,
    "4": logging.DEBUG,
    "7": logging.DEBUG,
}


@pytest.mark.parametrize("binary", [plugin_level, webhook_level, cli_level])
@pytest.mark.parametrize(("verbosity", "level"), SCALE.items())
def test_one_verbosity_scale_for_the_three_binaries(
    binary: Callable[[str | None], int], verbosity: str, level: int
) -> None:
    assert binary(verbosity) == level
    http_client = logging.getLogger("urllib3").level
    assert http_client == (logging.DEBUG if int(verbosity) >= 5 else logging.ERROR)


def test_daemons_log_info_by_default_and_the_cli_warnings() -> None:
    assert plugin_level(None) == webhook_level(None) == logging.INFO
    assert cli_level(None) == logging.WARNING


def gpu_dra(*args: str) -> subprocess.CompletedProcess[str]:
    """gpu-dra in a process of its own: its log records go to its real stderr."""
    code = "import sys; from driver.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_debug_records_reach_stderr_only_with_v4() -> None:
    inventory = ("inventory", "--mock", "", "--node-name", "n1", "-o", "json")
    quiet = gpu_dra(*inventory)
    info = gpu_dra("-v", "1", *inventory)
    loud = gpu_dra("-v", "4", *inventory)
    assert quiet.returncode == info.returncode == loud.returncode == 0, loud.stderr
    assert quiet.stdout == loud.stdout  # the command's output does not change
    assert "WARNING driver.nvml.mock.mock_backend: USING MOCK NVML" in quiet.stderr
    assert "DEBUG" not in quiet.stderr + info.stderr
    assert "DEBUG driver.nvml.discovery: GPU GPU-" in loud.stderr


@pytest.mark.parametrize("bad", ["x", "-1"])
def test_bad_verbosity_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args([f"--v={bad}", "journal", "show"])
    assert exc.value.code == 2
    assert "-v/--v" in capsys.readouterr().err


def test_webhook_help_shows_each_flags_env_and_default() -> None:
    parser = webhook_main.build_parser()
    text = " ".join(parser.format_help().split())
    assert "(env PORT, default: 443)" in text
    assert "(env DRIVER_NAME, default: gpu.example.com)" in text
    assert "(env LOG_LEVEL, default: none)" in text
    assert "(env V, default: 2)" in text
    assert "(env TLS_CERT_FILE, default: none)" in text
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "version"):
            assert action.help and "(env " in action.help and "default: " in action.help


def test_webhook_flags_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in zip(
        WEBHOOK_ENV, ("c.pem", "k.pem", "9443", "::", "gpu.other.com"), strict=True
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("V", "4")
    args = webhook_main.parse_args([])
    assert (args.tls_cert_file, args.tls_private_key_file) == ("c.pem", "k.pem")
    assert (args.port, args.bind_address, args.driver_name) == (9443, "::", "gpu.other.com")
    assert (args.log_level, args.verbosity) == (None, 4)
    webhook_main.configure_logging(args)
    assert logging.getLogger().level == logging.DEBUG
    # The command line wins over the environment; an explicit level wins over -v.
    monkeypatch.setenv("LOG_LEVEL", "ERROR")
    args = webhook_main.parse_args(["--port", "8443", "--v", "0", "--log-level", "WARNING"])
    webhook_main.configure_logging(args)
    assert (args.port, logging.getLogger().level) == (8443, logging.WARNING)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LOG_LEVEL": "LOUD"}, "--log-level (or LOG_LEVEL): 'LOUD'"),
        ({"PORT": "https"}, "--port"),
        ({"V": "high"}, "-v/--v"),
        ({"V": "-1"}, "must be >= 0"),
        ({}, "--tls-cert-file"),
    ],
)
def test_webhook_bad_or_missing_env_values_are_usage_errors(
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if env:
        monkeypatch.setenv("TLS_CERT_FILE", "c.pem")
        monkeypatch.setenv("TLS_PRIVATE_KEY_FILE", "k.pem")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        webhook_main.parse_args([])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
