"""The CUDA client of the MPS container test (tests/gpu/cuda_bound.py) and the test's
side of it (tests/gpu/bound_clients.py) on a stand-in for libcuda (tests/fake_cuda.py):
the report a client gives, its parse, and two clients driven in lock-step in processes
of their own, as tests/gpu/test_mps_containers.py drives two containers."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.fake_cuda import CUDA_ERROR_OUT_OF_MEMORY, FakeCuda
from tests.gpu.bound_clients import (
    Allocation,
    BoundReport,
    Client,
    context_memory,
    finish,
    reach,
    release,
)
from tests.gpu.cuda_bound import HOLDING, READY, run

REPO = Path(__file__).resolve().parents[2]
SERVE = "from tests.fake_cuda import serve; serve()"


def test_a_client_reports_its_bound_and_allocates_under_it_only(tmp_path: Path) -> None:
    cuda = FakeCuda(2048, tmp_path / "held")
    out = io.StringIO()
    assert run(cuda, 64, io.StringIO("go\ngo\n"), out) == 0
    lines = out.getvalue().splitlines()
    assert lines[2:] == [READY, "alloc 1841 result=2", "alloc 1713 result=0", HOLDING, "done"]
    report = BoundReport.parse(lines)
    assert (report.free_mib, report.total_mib) == (2048 - 271, 143771)
    assert (report.context_sms, report.device_sms) == ("66", 132)
    assert report.over == Allocation(1841, CUDA_ERROR_OUT_OF_MEMORY)
    assert report.under == Allocation(1713, 0)
    assert cuda.allocated == {} and not (tmp_path / "held").exists()


def test_a_failed_context_ends_the_report_with_the_call_and_its_result(tmp_path: Path) -> None:
    out = io.StringIO()
    cuda = FakeCuda(2048, tmp_path / "held", context_error=805)
    assert run(cuda, 64, io.StringIO(""), out) == 4
    assert out.getvalue().splitlines() == ["error cuCtxCreate 805"]
    with pytest.raises(ValueError, match=r"no `memory free=<MiB> total=<MiB>` line"):
        BoundReport.parse(out.getvalue().splitlines())


def test_the_parse_names_what_is_missing_and_ignores_other_lines() -> None:
    lines = ["runc: some warning", "memory free=1777 total=143771", "sm context=error 1 device=132"]
    with pytest.raises(ValueError, match=r"no `alloc <MiB> result=<n>` line"):
        BoundReport.parse(lines)
    with pytest.raises(ValueError, match=r"two `alloc` lines expected"):
        BoundReport.parse([*lines, "alloc 1841 result=2"])
    assert context_memory(lines) == (1777, 143771)
    with pytest.raises(ValueError, match=r"no `memory free=<MiB> total=<MiB>` line"):
        context_memory(lines[2:])
    report = BoundReport.parse([*lines, "alloc 1841 result=2", "noise", "alloc 1713 result=0"])
    assert report.context_sms == "error 1" and report.under == Allocation(1713, 0)


def _process(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _running(stack: ExitStack, *argv: str) -> subprocess.Popen[str]:
    proc = _process(*argv)
    stack.callback(proc.wait)
    stack.callback(proc.kill)
    return proc


def test_two_clients_hold_their_allocations_at_once_between_the_barriers(
    tmp_path: Path, stack: ExitStack
) -> None:
    held = [tmp_path / "small.held", tmp_path / "large.held"]
    clients = [
        Client(name, _running(stack, "-c", SERVE, str(limit), "64", str(marker)))
        for name, limit, marker in (("small", 2048, held[0]), ("large", 4096, held[1]))
    ]
    reach(clients, READY)
    assert not any(marker.exists() for marker in held)  # each waits for its release
    release(clients)
    reach(clients, HOLDING)
    assert all(marker.exists() for marker in held)  # both hold memory at this moment
    small, large = (client.report() for client in clients)
    assert large.free_mib - small.free_mib == 4096 - 2048
    release(clients)
    assert finish(clients) == [0, 0]
    assert not any(marker.exists() for marker in held)


def test_a_client_that_ends_early_fails_with_what_it_said(stack: ExitStack) -> None:
    client = Client("early", _running(stack, "-c", "print('memory free=1 total=2')"))
    with pytest.raises(AssertionError, match=r"early ended \(exit 0\) before 'ready'") as err:
        client.until(READY)
    assert "memory free=1 total=2" in str(err.value)


def test_a_silent_client_fails_instead_of_hanging_the_test(stack: ExitStack) -> None:
    client = Client("silent", _running(stack, "-c", "import sys; sys.stdin.read()"), timeout=0.2)
    with pytest.raises(AssertionError, match=r"silent: silent for 0.2s while 'holding'"):
        client.until(HOLDING)
