"""Run one `pip install` step of `make venv` and print its progress as counts.

    python3 hack/pip_progress.py --step 3/4 --lock requirements.lock -- \
        .venv/bin/python -m pip install --require-hashes -r requirements.lock

Without this, pip is either silent for minutes (--quiet) or prints several hundred
lines. This prints one line per phase change, and at most one line every
--interval seconds within a phase:

    [venv 3/4   12s] fetching: 23/56 packages resolved, 22 downloaded (last: grpcio==1.85.1)
    [venv 3/4   29s] fetching: 56/56 packages resolved, 55 downloaded (last: setuptools-...)
    [venv 3/4   29s] installing 55 packages: pip says nothing until it is done
    [venv 3/4   47s] still installing 55 packages: no output for 16s
    [venv 3/4   69s] done: 55 packages installed

The total is the number of pinned requirements in --lock. When pip prints nothing for
--quiet-after seconds, a line says that it is still working. If pip fails, its last 40
lines go to stderr and this script exits with pip's exit status. It uses only the
standard library, so the bootstrap interpreter can run it before the venv exists.
"""

from __future__ import annotations

import argparse
import queue
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
COLLECTING = re.compile(r"^(?:Collecting|Requirement already satisfied:) (\S+)")
# "Downloading grpcio-1.85.1-....whl (6.2 MB)", "Using cached grpcio-....whl (6.2 MB)".
# Metadata files (PEP 658) are fetched during resolution and are not counted.
DOWNLOADING = re.compile(r"^(?:Downloading|Using cached) (\S+?)(?: \(([^)]*)\))?$")
INSTALLING = re.compile(r"^Installing collected packages: (.*)$")
SUCCESS = re.compile(r"^Successfully installed (.*)$")
TAIL_LINES = 40


def _packages(count: int) -> str:
    return f"{count} package{'' if count == 1 else 's'}"


def locked_package_count(lock: Path) -> int:
    """The pinned requirements (`name==version`) of a requirements file."""
    return sum(1 for line in lock.read_text().splitlines() if PINNED.match(line))


@dataclass
class PipProgress:
    """Turns pip's output lines into short progress lines (pure, for tests)."""

    total: int | None
    phase: str = "starting"
    resolved: int = 0
    downloaded: int = 0
    installing: int = 0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))

    def _of_total(self, count: int) -> str:
        return f"{count}/{self.total}" if self.total else str(count)

    def _fetching(self, last: str) -> tuple[str, str]:
        self.phase = "fetching"
        return self.phase, (
            f"fetching: {self._of_total(self.resolved)} packages resolved, "
            f"{self.downloaded} downloaded (last: {last})"
        )

    def feed(self, raw: str) -> tuple[str, str] | None:
        """(phase, line) for a pip output line that moves things on, else None."""
        line = raw.strip()
        self.tail.append(raw.rstrip("\n"))
        if match := COLLECTING.match(line):
            self.resolved += 1
            return self._fetching(match[1])
        if (match := DOWNLOADING.match(line)) and not match[1].endswith(".metadata"):
            self.downloaded += 1
            return self._fetching(f"{match[1]}, {match[2]}" if match[2] else match[1])
        if match := INSTALLING.match(line):
            self.installing = len([name for name in match[1].split(",") if name.strip()])
            self.phase = "installing"
            return self.phase, (
                f"installing {_packages(self.installing)}: pip says nothing until it is done"
            )
        if match := SUCCESS.match(line):
            self.phase = "done"
            return self.phase, f"done: {_packages(len(match[1].split()))} installed"
        return None

    def still(self, seconds: float) -> str:
        what = {
            "installing": f"installing {_packages(self.installing)}",
            "fetching": f"fetching ({self._of_total(self.resolved)} packages resolved so far)",
        }.get(self.phase, "waiting for pip")
        return f"still {what}: no output for {seconds:.0f}s"


def _read_lines(stream: Iterable[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run(
    command: Sequence[str],
    progress: PipProgress,
    say: Callable[[str], None],
    *,
    interval: float = 2.0,
    quiet_after: float = 15.0,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run `command`, print progress through `say`, return its exit status."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    last_said = last_output = clock()
    said_phase = ""
    pending: str | None = None  # a line held back by `interval`
    while True:
        try:
            line = lines.get(timeout=min(interval, quiet_after))
        except queue.Empty:
            line = ""
        now = clock()
        if line is None:
            break
        if line:
            last_output = now
            if (event := progress.feed(line)) is not None:
                phase, text = event
                if phase != said_phase and pending is not None:
                    say(pending)  # the last word on the phase that ends
                if phase != said_phase or now - last_said >= interval:
                    say(text)
                    said_phase, last_said, pending = phase, now, None
                else:
                    pending = text
        elif pending is not None and now - last_said >= interval:
            say(pending)
            last_said, pending = now, None
        elif now - max(last_output, last_said) >= quiet_after:
            say(progress.still(now - last_output))
            last_said = now
    if pending is not None:
        say(pending)
    status = proc.wait()
    if status != 0:
        print(f"pip failed (exit status {status}); its last lines:", file=sys.stderr)
        print("\n".join(progress.tail), file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", required=True, help="shown in every line, e.g. 3/4")
    parser.add_argument("--lock", type=Path, help="requirements file giving the total")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between lines")
    parser.add_argument(
        "--quiet-after", type=float, default=15.0, help="seconds of silence before a line"
    )
    parser.add_argument("command", nargs="+", help="the pip command, after --")
    args = parser.parse_args(argv)
    total = locked_package_count(args.lock) if args.lock else None
    start = time.monotonic()

    def say(text: str) -> None:
        print(f"[venv {args.step} {time.monotonic() - start:4.0f}s] {text}", flush=True)

    say(f"pip install{f': {_packages(total)} in {args.lock}' if total else ''}")
    return run(
        args.command,
        PipProgress(total),
        say,
        interval=args.interval,
        quiet_after=args.quiet_after,
    )


if __name__ == "__main__":
    sys.exit(main())
