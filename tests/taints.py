"""Published taints as most tests compare them: without `timeAdded`, which is when the
failure was recorded (checked on its own in tests/unit/test_health_store.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def untimed(taints: Mapping[str, Sequence[Mapping[str, str]]]) -> dict[str, list[dict[str, str]]]:
    return {
        name: [{k: v for k, v in taint.items() if k != "timeAdded"} for taint in listed]
        for name, listed in taints.items()
    }
