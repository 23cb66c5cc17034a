"""The test's side of tests/gpu/cuda_bound.py: processes (containers) that run it,
driven in lock-step through their stdin and stdout, and the parse of what each
reported."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from queue import Empty, Queue

from tests.gpu.cuda_bound import DONE

_MEMORY = re.compile(r"memory free=(\d+) total=(\d+)$")
_SMS = re.compile(r"sm context=(.+) device=(\d+)$")
_ALLOC = re.compile(r"alloc (-?\d+) result=(\d+)$")


def _found(pattern: re.Pattern[str], what: str, lines: Sequence[str]) -> list[re.Match[str]]:
    matches = [m for m in map(pattern.match, lines) if m is not None]
    if not matches:
        raise ValueError(f"no `{what}` line in the client's report: {list(lines)}")
    return matches


def context_memory(lines: Sequence[str]) -> tuple[int, int]:
    """The free and total MiB its context reported (ValueError if it did not)."""
    memory = _found(_MEMORY, "memory free=<MiB> total=<MiB>", lines)[0]
    return int(memory[1]), int(memory[2])


@dataclass(frozen=True)
class Allocation:
    mib: int
    result: int  # CUresult: 0 success, 2 CUDA_ERROR_OUT_OF_MEMORY


@dataclass(frozen=True)
class BoundReport:
    """What one client reported: its context's free and total memory (MiB), its SM
    counts, then the allocation just over its free memory and the one just under."""

    free_mib: int
    total_mib: int
    context_sms: str
    device_sms: int
    over: Allocation
    under: Allocation

    @classmethod
    def parse(cls, lines: Sequence[str]) -> BoundReport:
        """From the client's lines (others among them are ignored); ValueError naming
        the line that is missing."""
        free, total = context_memory(lines)
        sms = _found(_SMS, "sm context=<n> device=<n>", lines)[0]
        allocs = _found(_ALLOC, "alloc <MiB> result=<n>", lines)
        if len(allocs) != 2:
            raise ValueError(f"two `alloc` lines expected in the client's report: {list(lines)}")
        over, under = (Allocation(int(m[1]), int(m[2])) for m in allocs)
        return cls(free, total, sms[1], int(sms[2]), over, under)


@dataclass
class Client:
    """A process that runs cuda_bound (its stdout with stderr merged into it); a
    thread collects its lines. `timeout`: how long it may stay silent while a marker
    is awaited (a hung client fails the test instead of hanging it)."""

    name: str
    proc: subprocess.Popen[str]
    timeout: float = 120.0
    lines: list[str] = field(default_factory=list, init=False)
    _queue: Queue[str | None] = field(default_factory=Queue, init=False, repr=False)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def said(self) -> str:
        return "\n".join(self.lines) or "(nothing)"

    def until(self, marker: str) -> None:
        """Collect its lines up to `marker`; AssertionError, with what it said, if it
        ends or stays silent first."""
        while True:
            try:
                line = self._queue.get(timeout=self.timeout)
            except Empty:
                raise AssertionError(
                    f"{self.name}: silent for {self.timeout:g}s while {marker!r} was "
                    f"awaited; it said:\n{self.said()}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"{self.name} ended (exit {self.proc.wait()}) before {marker!r}; "
                    f"it said:\n{self.said()}"
                )
            self.lines.append(line)
            if line == marker:
                return

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def report(self) -> BoundReport:
        return BoundReport.parse(self.lines)


def reach(clients: Sequence[Client], marker: str) -> None:
    """Wait until every client has said `marker` (each then waits for its release)."""
    for client in clients:
        client.until(marker)


def release(clients: Sequence[Client]) -> None:
    for client in clients:
        client.release()


def finish(clients: Sequence[Client]) -> list[int]:
    """Their exit statuses, once each has said it is done."""
    reach(clients, DONE)
    return [client.proc.wait(timeout=client.timeout) for client in clients]
