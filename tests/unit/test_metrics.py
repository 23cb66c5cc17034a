"""The plugin's metrics: names and types as exposed, and counts kept elsewhere."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from driver.observability import metrics
from driver.plugin.dra import DraService
from driver.proto.dra.v1 import api_pb2 as v1
from driver.state.request import PrepareResult


def _exposed_types() -> dict[str, str]:
    text = generate_latest(metrics.REGISTRY).decode()
    return {
        line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")
    }


@pytest.mark.parametrize("name", ["gpu_dra_api_writes_total", "gpu_dra_nvml_calls_total"])
def test_running_counts_are_exposed_as_counters(name: str) -> None:
    assert _exposed_types()[name] == "counter"


def test_no_metric_that_only_grows_is_a_gauge() -> None:
    gauges = {name for name, kind in _exposed_types().items() if kind == "gauge"}
    gauges -= {name for name in gauges if name.endswith("_created")}
    assert gauges == {
        "gpu_dra_tainted_devices",
        "gpu_dra_unmonitored_gpus",
        "gpu_dra_published_devices",
        "gpu_dra_checkpoint_corrupt",
        "gpu_dra_health_store_corrupt",
        "gpu_dra_nvidia_toolkit_config",
        "gpu_dra_kubelet_registered",
        "gpu_dra_serving",
        "gpu_dra_prepared_claims",
        "gpu_dra_prepared_devices",
        "gpu_dra_requests_in_flight",
        "gpu_dra_gpu_healthy",
        "gpu_dra_gpus",
        "gpu_dra_build_info",
    }


def test_series_of_known_labels_are_zero_from_the_start() -> None:
    """A fresh process, before any event: `increase()` needs the series to exist."""
    script = (
        "from prometheus_client import generate_latest\n"
        "from driver.observability import metrics\n"
        "print(generate_latest(metrics.REGISTRY).decode())\n"
    )
    text = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for sample in [
        'gpu_dra_prepare_claims_total{outcome="ok"} 0.0',
        'gpu_dra_prepare_claims_total{outcome="transient"} 0.0',
        'gpu_dra_prepare_claims_total{outcome="invalid-config"} 0.0',
        'gpu_dra_prepare_claims_total{outcome="device-failed"} 0.0',
        'gpu_dra_unprepare_claims_total{outcome="error"} 0.0',
        'gpu_dra_permanent_verdict_replays_total{error_class="device-failed"} 0.0',
        'gpu_dra_socket_recreations_total{socket="registration"} 0.0',
        'gpu_dra_requests_in_flight{method="prepare"} 0.0',
        'gpu_dra_requests_in_flight{method="unprepare"} 0.0',
    ]:
        assert sample in text.splitlines(), sample


def test_requests_in_flight_while_a_prepare_runs() -> None:
    release, entered = threading.Event(), threading.Event()

    class SlowState:
        def prepare(self, claims: Any) -> dict[str, Any]:
            entered.set()
            release.wait(10)
            return {c.uid: PrepareResult(devices=()) for c in claims}

        def unprepare(self, claims: Any) -> dict[str, Any]:
            return {}

    def in_flight() -> float | None:
        return metrics.REGISTRY.get_sample_value(
            "gpu_dra_requests_in_flight", {"method": "prepare"}
        )

    # One claim: an empty request (the readiness probe's) is answered without counting.
    claim = v1.Claim(namespace="ns", uid="8f5a2c1e-1d2b-4c3d-9e4f-5a6b7c8d9e0f", name="c")
    request = v1.NodePrepareResourcesRequest(claims=[claim])
    before = in_flight()
    answers: list[Any] = []
    worker = threading.Thread(
        target=lambda: answers.append(DraService(SlowState()).prepare(request, None, v1)),
        daemon=True,
    )
    worker.start()
    assert entered.wait(10)
    assert in_flight() == (before or 0) + 1
    release.set()
    worker.join(10)
    assert in_flight() == before
    assert [list(a.claims) for a in answers] == [[claim.uid]]  # answered, not raised


def test_counted_elsewhere_reads_its_sources_at_scrape() -> None:
    registry = CollectorRegistry()
    calls = metrics.CountedElsewhere("test_calls", "Calls.", ("caller",), registry=registry)
    counts = {"a": 1, "b": 5}
    calls.count_from(lambda: counts["a"], caller="a")
    calls.count_from(lambda: counts["b"], caller="b")
    assert registry.get_sample_value("test_calls_total", {"caller": "a"}) == 1
    counts["a"] = 7
    assert registry.get_sample_value("test_calls_total", {"caller": "a"}) == 7
    assert registry.get_sample_value("test_calls_total", {"caller": "b"}) == 5
    assert "# TYPE test_calls_total counter" in generate_latest(registry).decode()


def test_counted_elsewhere_replaces_the_source_of_a_label_set() -> None:
    registry = CollectorRegistry()
    writes = metrics.CountedElsewhere("test_writes", "Writes.", registry=registry)
    assert registry.get_sample_value("test_writes_total") is None
    writes.count_from(lambda: 3)
    writes.count_from(lambda: 4)
    assert registry.get_sample_value("test_writes_total") == 4


def test_counted_elsewhere_names_missing_or_unknown_labels() -> None:
    calls = metrics.CountedElsewhere(
        "test_labelled", "Calls.", ("caller",), registry=CollectorRegistry()
    )
    with pytest.raises(ValueError, match=r"test_labelled: labels \[\] given, \['caller'\]"):
        calls.count_from(lambda: 1)
    with pytest.raises(ValueError, match=r"labels \['thread'\] given"):
        calls.count_from(lambda: 1, thread="x")


def test_a_second_metric_of_the_same_name_is_refused() -> None:
    registry = CollectorRegistry()
    metrics.CountedElsewhere("test_twice", "Once.", registry=registry)
    with pytest.raises(ValueError, match="test_twice"):
        metrics.CountedElsewhere("test_twice", "Twice.", registry=registry)


def test_operations_doc_lists_every_exposed_metric_and_no_other() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    table = doc.split("## Metrics of the kubelet plugin", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(gpu_dra_\w+)` \|", table, flags=re.MULTILINE))
    exposed = {name for name in _exposed_types() if not name.endswith("_created")}
    assert documented == exposed
