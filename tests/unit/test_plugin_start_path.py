"""What stands between gpu-kubelet-plugin's start and the kubelet's registration: the
Node GET runs beside recovery and discovery, not after them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.kube.api import ApiError, KubeApi
from driver.nvml.backend import NvmlBackend
from driver.plugin import main as plugin_main
from driver.plugin.options.flags import parse_options
from driver.plugin.options.node_overrides import NodeLabelRead
from driver.plugin.options.settings import SettingError

NODE = "n1"
REPO = Path(__file__).resolve().parents[2]
WAIT = 5.0


class NodeOnlyApi:
    """Answers the Node GET (after `answer_when` is set, or WAIT seconds); every other
    request fails as an API server that is not ready does."""

    writes = 0

    def __init__(self, labels: dict[str, str], answer_when: threading.Event) -> None:
        self.labels = labels
        self.answer_when = answer_when
        self.node_get_sent = threading.Event()
        self.answer_when_was_set: bool | None = None

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        if method == "GET" and path == f"/api/v1/nodes/{NODE}":
            self.node_get_sent.set()
            self.answer_when_was_set = self.answer_when.wait(WAIT)
            return {"metadata": {"name": NODE, "labels": self.labels}}
        raise ApiError(503, "Service Unavailable")

    def watch(self, path: str, **_: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        raise ApiError(503, "Service Unavailable")


def test_the_node_label_is_read_while_recovery_and_discovery_run(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    discovered = threading.Event()
    api = NodeOnlyApi({"gpu.example.com/mig-profiles": "1g10gb"}, answer_when=discovered)
    monkeypatch.setattr(KubeApi, "from_kubeconfig", classmethod(lambda cls, path=None: api))
    get_in_flight_at_discovery: list[bool] = []
    discover = NvmlBackend.discover

    def discover_beside_the_node_get(backend: NvmlBackend) -> Any:
        get_in_flight_at_discovery.append(api.node_get_sent.wait(WAIT))
        try:
            return discover(backend)
        finally:
            discovered.set()

    monkeypatch.setattr(NvmlBackend, "discover", discover_beside_the_node_get)
    registry = short_dir / "registry"
    options = parse_options(
        [
            f"--node-name={NODE}",
            "--nvml-backend=mock",
            f"--kubelet-plugins-directory-path={short_dir / 'plugins'}",
            f"--kubelet-registrar-directory-path={registry}",
            f"--cdi-root={short_dir / 'cdi'}",
            "--http-port=-1",
        ]
    )
    plugin = plugin_main.Plugin(options, "test")
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(plugin.run())
        except BaseException as err:  # reported by the test thread
            outcome.append(err)

    caplog.set_level(logging.INFO)
    thread = threading.Thread(target=run, name="plugin")
    thread.start()
    try:
        for _ in range(int(4 * WAIT / 0.01)):
            if outcome or (registry.exists() and any(registry.iterdir())):
                break
            threading.Event().wait(0.01)
    finally:
        plugin.stopping.set()
        thread.join(4 * WAIT)
    assert outcome == [0], outcome
    assert get_in_flight_at_discovery == [True], "discovery ran before the Node GET was sent"
    assert api.answer_when_was_set, "the Node GET was answered before discovery ended"
    assert "MIG profiles from the Node's label: 1g10gb" in caplog.text


def test_a_bad_label_read_beside_the_start_stops_it_naming_the_label() -> None:
    answered = threading.Event()
    answered.set()
    api = NodeOnlyApi({"gpu.example.com/mig-profiles": "2g.99"}, answer_when=answered)
    read = NodeLabelRead(api, NODE, "gpu.example.com")
    with pytest.raises(SettingError, match=r"node label gpu.example.com/mig-profiles='2g.99'"):
        read.profiles()


def test_a_node_that_cannot_be_read_leaves_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    class DownApi:
        def request(self, method: str, path: str) -> object:
            raise ApiError(503, "Service Unavailable")

    assert NodeLabelRead(DownApi(), NODE, "gpu.example.com").profiles() is None
    assert f"reading Node {NODE} for its gpu.example.com/mig-profiles label" in caplog.text
