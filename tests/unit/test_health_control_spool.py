"""The control channel's spool files are messages, not records: a request and its
answer are written atomically (a reader never sees half of one) but never fsynced,
since a plugin drops whatever a previous instance left in the spool when it starts.
Waiting for the disk there only delays `gpu-dra mock xid` reaching the event wait."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from driver.health.control import ControlChannel, deliver


def test_a_request_and_its_answer_reach_the_disk_without_an_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = ControlChannel(tmp_path)
    channel.register("ping", lambda request: {"message": f"pong {request['n']}"})
    channel.activate()
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counted(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    answers: list[dict[str, Any]] = []
    client = threading.Thread(
        target=lambda: answers.append(deliver(tmp_path, {"action": "ping", "n": 7}, timeout=10))
    )
    client.start()
    while client.is_alive():
        channel.poll()
        client.join(0.005)
    assert answers == [{"ok": True, "message": "pong 7"}]
    assert fsyncs == []
    assert not [p for p in channel.dir.iterdir() if p.name.startswith(("req-", "res-", "."))]
