"""How the backend calls NVML: every `nvml*` call counted per calling thread, NVML
error codes tested by name, optional queries, NVML strings as text."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Answers that mean "this GPU has no such attribute" rather than a failure.
_ABSENT_ATTRIBUTE_ERRORS = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NO_PERMISSION",
)


class CountingModule:
    """Counts calls of the module's `nvml*` functions per calling thread; everything
    else passes through.

    The counts back the `gpu_dra_nvml_calls_total{caller=...}` metric, which is how tests and
    operators see that a remembered permanent verdict costs no NVML call while the
    health monitor keeps polling for events on its own thread.
    """

    def __init__(self, module: Any) -> None:
        self.wrapped = module
        self.counts: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.wrapped, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[threading.current_thread().name] += 1
            return value(*args, **kwargs)

        return counted


def is_nvml_error(nvml: Any, err: BaseException, *names: str) -> bool:
    """Whether `err` is the module's NVMLError with one of the return codes `names`."""
    value = getattr(err, "value", None)
    return isinstance(err, nvml.NVMLError) and any(value == getattr(nvml, n, None) for n in names)


def optional_query(nvml: Any, fn: Callable[[], _T], what: str, uuid: str = "") -> _T | None:
    """Call `fn`; NOT_SUPPORTED (and friends) mean "no such attribute", not a failure."""
    try:
        return fn()
    except nvml.NVMLError as err:
        if is_nvml_error(nvml, err, *_ABSENT_ATTRIBUTE_ERRORS):
            log.debug("NVML %s not available %s: %s", what, uuid, err)
            return None
        raise


def nvml_text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
