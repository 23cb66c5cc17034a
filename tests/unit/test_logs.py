"""Structured logs: JSON lines that carry the request id of the call they belong to."""

from __future__ import annotations

import json
import logging

import pytest

from driver.observability.logs import request_scope, setup_logging


def test_json_lines_carry_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("json", 0)
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
    setup_logging("text", 0)
    log = logging.getLogger("driver.test")
    with request_scope("outer") as outer:
        with request_scope("inner") as inner:
            log.info("a")
        log.info("b")
    err = capsys.readouterr().err.splitlines()
    assert f"[{inner}] a" in err[0] and f"[{outer}] b" in err[1]
    assert outer != inner


def test_api_client_debug_logging_is_silenced() -> None:
    setup_logging("text", 10)
    assert logging.getLogger().level == logging.DEBUG
    assert logging.getLogger("urllib3").level == logging.WARNING
