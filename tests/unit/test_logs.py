"""Structured logs: JSON lines that carry the request id of the call they belong to;
an API outage logged once per interval, not once per attempt."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.kube.api import KubeApi
from driver.kube.publisher import SlicePublisher
from driver.observability.logs import request_scope, setup_logging


def test_json_lines_carry_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("json", 1)
    log = logging.getLogger("driver.test")
    with request_scope("prepare") as rid:
        log.info("preparing %s", "ns/claim")
    log.warning("outside")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["msg"] == "preparing ns/claim"
    assert lines[0]["requestID"] == rid and rid.startswith("prepare-")
    assert lines[0]["level"] == "info" and lines[0]["logger"] == "driver.test"
    assert lines[1]["requestID"] == "-"


def test_nested_scopes_restore_the_outer_id(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("text", 1)
    log = logging.getLogger("driver.test")
    with request_scope("outer") as outer:
        with request_scope("inner") as inner:
            log.info("a")
        log.info("b")
    err = capsys.readouterr().err.splitlines()
    assert f"[{inner}] a" in err[0] and f"[{outer}] b" in err[1]
    assert outer != inner


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, levels = root.handlers[:], {n: logging.getLogger(n).level for n in LOGGERS}
    yield
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


LOGGERS = ("", "urllib3")


def unreachable_api(tmp_path: Path) -> KubeApi:
    """An API server that refuses every connection (a closed local port)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    return KubeApi.from_kubeconfig(str(kubeconfig))


def test_an_api_outage_is_logged_once_not_per_attempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    setup_logging("text", 2)  # the chart's default verbosity
    spec = {"driver": "gpu.example.com", "nodeName": "n1", "devices": [{"name": "gpu-0"}]}
    publisher = SlicePublisher(
        unreachable_api(tmp_path), driver="gpu.example.com", node_name="n1", desired=lambda: [spec]
    )
    publisher.start()
    time.sleep(4)
    publisher.stop()
    time.sleep(0.2)
    lines = capsys.readouterr().err.splitlines()
    loud = [line for line in lines if " WARNING " in line or " ERROR " in line]
    # One line for each loop that met the outage (publishing, watching), none per retry.
    assert 1 <= len(loud) <= 2, "\n".join(loud)
    assert all("retrying in" in line and "logged every 60s" in line for line in loud), loud


def test_retry_log_logs_once_per_interval_and_the_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from driver.observability.logs import RetryLog

    now = [0.0]
    retries = RetryLog(logging.getLogger("driver.test"), "publishing", clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="driver.test"):
        for second in range(125):  # a failure a second for just over two minutes
            now[0] = float(second)
            retries.failed(ConnectionError("refused"), 1.0)
        retries.failed(TimeoutError("slow"), 1.0)  # another kind of failure: told at once
        now[0] = 130.0
        retries.succeeded()
        retries.succeeded()  # nothing to tell: it was not failing
    above_debug = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > 10]
    assert [level for level, _ in above_debug] == ["WARNING"] * 4 + ["INFO"]
    assert "still failing: 61 attempts in 60s" in above_debug[1][1]
    assert "slow" in above_debug[3][1]
    assert above_debug[4][1] == "publishing works again after 126 failed attempt(s) in 130s"
