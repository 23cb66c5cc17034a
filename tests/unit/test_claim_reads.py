"""Claims of one prepare request are read from the API concurrently, answered in order."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

from driver.errors import DriverError, transient
from driver.state.request import PARALLEL_READS, ClaimRef, read_claims


class BarrierReader:
    """Answers only once `parties` reads are in flight at the same time: a reader that
    is called one claim at a time times out instead."""

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties, timeout=5)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        # A reader called one claim at a time breaks the barrier after its timeout:
        # then the assertion on most_in_flight fails instead of the test hanging.
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait()
        with self.lock:
            self.in_flight -= 1
        if name == "gone":
            raise transient(f"{namespace}/{name} not found")
        if name == "broken":
            raise RuntimeError("reader bug")
        if name == "odd":
            return []  # type: ignore[return-value]
        return {"metadata": {"namespace": namespace, "name": name}}


def refs(names: list[str]) -> list[ClaimRef]:
    return [ClaimRef("ns", name, f"uid-{i}") for i, name in enumerate(names)]


def test_a_batch_is_read_concurrently_and_answered_in_order() -> None:
    names = [f"c{i}" for i in range(3 * PARALLEL_READS)]
    reader = BarrierReader(PARALLEL_READS)
    out = read_claims(reader, refs(names))
    assert [c["metadata"]["name"] for c in out if isinstance(c, dict)] == names
    assert reader.most_in_flight == PARALLEL_READS


def test_each_claim_gets_its_own_read_error() -> None:
    reader = BarrierReader(4)
    out = read_claims(reader, refs(["a", "gone", "broken", "odd"]))
    assert out[0] == {"metadata": {"namespace": "ns", "name": "a"}}
    errors = out[1:]
    assert all(isinstance(e, DriverError) and not e.permanent for e in errors)
    assert [str(e) for e in errors] == [
        "ns/gone not found",
        "internal error: reader bug",
        "claim ns/odd: API returned no object",
    ]


@pytest.mark.parametrize("n", [0, 1])
def test_a_single_claim_is_read_on_the_calling_thread(n: int) -> None:
    seen: list[str] = []

    class Reader:
        def get(self, namespace: str, name: str) -> dict[str, Any]:
            seen.append(threading.current_thread().name)
            return {}

    assert read_claims(Reader(), refs(["a"] * n)) == [{}] * n
    assert seen == [threading.current_thread().name] * n
