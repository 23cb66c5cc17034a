"""Collaborators of DeviceState for tests that run it in-process: every device is
healthy, and a permanent failure is a test failure."""

from __future__ import annotations

from typing import Any


class Healthy:
    def failure(self, device_name: str) -> str | None:
        return None

    def ensure_tainted(self, device_name: str) -> None:
        raise AssertionError("nothing is failed")


class NoReports:
    def permanent_failure(self, claim: dict[str, Any], error: Any) -> None:
        raise AssertionError(f"unexpected permanent error {error}")
