"""The README's table of `gpu-dra` commands says what each command's own help line
says: every subcommand (and every action of one, `health clear`, `journal show`, ...)
has a row, no row names a command that does not exist, and each row's text is the
command's line in `gpu-dra --help` (or `gpu-dra <command> --help`), word for word."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from driver.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| command | its line in `gpu-dra --help` |"


def help_lines(
    parser: argparse.ArgumentParser, prefix: str = "gpu-dra"
) -> Iterator[tuple[str, str]]:
    """(`gpu-dra <command> [<action>]`, its one-line help) of every subcommand."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            yield f"{prefix} {name}", str(helps.get(name))
            yield from help_lines(sub, f"{prefix} {name}")


def readme_table() -> dict[str, str]:
    """The rows of the README's command table: command -> text."""
    lines = README.read_text().splitlines()
    assert HEADER in lines, f"README.md has no table headed {HEADER}"
    rows: dict[str, str] = {}
    for line in lines[lines.index(HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        command, text = (cell.strip() for cell in line.strip("|").split("|", 1))
        assert command.startswith("`") and command.endswith("`"), line
        assert command.strip("`") not in rows, f"two rows for {command}"
        rows[command.strip("`")] = text
    return rows


def test_every_command_has_its_help_line_in_the_readme() -> None:
    assert readme_table() == dict(help_lines(build_parser()))


def test_help_lines_are_found_for_nested_commands() -> None:
    """The walk reaches actions of subcommands, so a new one cannot hide from the table."""
    commands = dict(help_lines(build_parser()))
    assert {"gpu-dra status", "gpu-dra health clear", "gpu-dra journal quarantine"} <= set(commands)
    assert all(text and text != "None" for text in commands.values()), commands
    # A table cell: a `|` in a help line would split it.
    assert not [text for text in commands.values() if "|" in text]
