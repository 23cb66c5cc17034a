"""`ConfigError`: a permanent invalid-config failure listing every bad field."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from driver.errors import DriverError, ErrorClass


class FieldError(NamedTuple):
    """One problem: the field path (e.g. `spec.devices.config[0].opaque.parameters.kind`)
    and what is wrong with it. An empty path means the document itself."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


class ConfigError(DriverError):
    """Invalid configuration (class INVALID_CONFIG, hence permanent).

    `errors` holds every problem found; `str(err)` is
    `permanent (invalid-config): <path>: <message>; <path>: <message>...`.
    """

    def __init__(self, errors: Iterable[tuple[str, str]]) -> None:
        self.errors: list[FieldError] = [FieldError(path, message) for path, message in errors]
        if not self.errors:
            raise ValueError("ConfigError needs at least one error")
        super().__init__(ErrorClass.INVALID_CONFIG, "; ".join(str(e) for e in self.errors))
