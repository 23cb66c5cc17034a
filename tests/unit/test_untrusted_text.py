"""Strings a tenant or any pod controls are escaped where they reach a log line or the
operator's terminal (issue 34, items 4 and 6): no forged log lines, no terminal escape
sequences, no megabyte lines."""

from __future__ import annotations

import argparse
import io
import json
import logging
from pathlib import Path

import pytest

from driver.cli.output import format_table
from driver.cli.validate import validate_command
from driver.observability.logs import MAX_LOGGED_CHARS, escaped, setup_logging
from driver.webhook import main as webhook_main

HOSTILE = "ok\nINFO forged line\x1b[2J\x1b]0;title\x07\u202edesrever\x85"


def test_escaped_keeps_printable_text_and_escapes_the_rest() -> None:
    assert escaped("plain text: ünïcode, 'quotes' \\ and tabs\tok") == (
        "plain text: ünïcode, 'quotes' \\ and tabs\\tok"
    )
    assert escaped(HOSTILE) == (
        "ok\\nINFO forged line\\x1b[2J\\x1b]0;title\\x07\\u202edesrever\\x85"
    )
    assert escaped("x" * 50, limit=10) == "xxxxxxxxxx... (40 more characters)"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_daemon_log_lines_escape_their_message(
    fmt: str, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    setup_logging(fmt, 2)
    logging.getLogger("driver.test").warning("denied %s", HOSTILE + "y" * (3 << 20))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\u202e" not in err
    assert len(err) < MAX_LOGGED_CHARS + 500
    message = json.loads(err)["msg"] if fmt == "json" else err
    assert "ok\\nINFO forged line\\x1b[2J" in message


def test_the_webhook_log_escapes_its_messages(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    """Before: the webhook logged a denial's field paths (tenant keys) verbatim."""
    root = logging.getLogger()
    root.handlers[:] = []
    webhook_main.configure_logging(
        webhook_main.parse_args(["--tls-cert-file=c", "--tls-private-key-file=k"])
    )
    logging.getLogger("driver.webhook.server").warning("denied uid-1: %s", HOSTILE)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err


def test_validate_prints_a_manifests_strings_escaped(tmp_path: Path) -> None:
    """Before: a key with terminal escapes went to the terminal as is."""
    manifest = tmp_path / "evil.yaml"
    manifest.write_text(
        "apiVersion: gpu.resource.example.com/v1alpha1\nkind: GpuConfig\n"
        'sharing: {strategy: TimeSlicing}\n"bad\\e[2J\\e]0;all valid\\akey\\nOK: fake": 1\n'
    )
    parser = argparse.ArgumentParser(prog="gpu-dra")
    validate_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["validate", str(manifest)])
    out, err = io.StringIO(), io.StringIO()
    assert args.run(args, stdin=io.StringIO(), out=out, err=err) == 1
    printed = out.getvalue() + err.getvalue()
    assert "\x1b" not in printed and "\x07" not in printed
    assert "bad\\x1b[2J\\x1b]0;all valid\\x07key\\nOK: fake: unknown field" in printed
    assert not any(line.startswith("OK: fake") for line in printed.splitlines())


def test_tables_escape_their_cells() -> None:
    table = format_table(["NAME"], [["gpu-0\x1b[31m\nfake-row"]])
    assert table == "NAME\ngpu-0\\x1b[31m\\nfake-row\n"
