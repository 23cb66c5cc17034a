"""What gpu-dra's subcommands write: plain-text tables, reports in the `-o` format, and
the streams they write to (and read answers from)."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TextIO

import yaml

from driver.observability.logs import escaped


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, one line per row, newline-terminated;
    non-printable characters in a cell escaped (`driver.observability.logs.escaped`)."""
    table = [tuple(headers), *(tuple(escaped(c) for c in r) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines) + "\n"


def print_report(
    report: dict[str, Any], output: str, out: TextIO, table: Callable[[dict[str, Any]], str]
) -> None:
    """`report` as `-o json` or `-o yaml` print it, else `table(report)`."""
    if output == "json":
        print(json.dumps(report, indent=2), file=out)
    elif output == "yaml":
        out.write(yaml.safe_dump(report, sort_keys=False))
    else:
        out.write(table(report))


class Command(Protocol):
    def __call__(self, args: Any, out: TextIO, err: TextIO, stdin: TextIO) -> int: ...


def std_streams(command: Command) -> Callable[..., int]:
    """`command` run with the streams a caller (a test) gives by name, else the
    process's own (looked up at each call: pytest replaces them)."""

    @functools.wraps(command)
    def run(
        args: Any,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        stdin: TextIO | None = None,
    ) -> int:
        return command(
            args,
            out if out is not None else sys.stdout,
            err if err is not None else sys.stderr,
            stdin if stdin is not None else sys.stdin,
        )

    return run
