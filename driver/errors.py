"""Error classification shared by every failure path (docs/architecture.md "Errors", KEP-5322)."""

from __future__ import annotations

import enum
from typing import Final


class ErrorClass(enum.Enum):
    TRANSIENT = "transient"
    INVALID_CONFIG = "invalid-config"
    DEVICE_FAILED = "device-failed"


DEFAULT_PERMANENT_ERRORS: Final = frozenset({ErrorClass.INVALID_CONFIG, ErrorClass.DEVICE_FAILED})


class DriverError(Exception):
    """A failure with a verdict: can retrying ever help?

    `str(err)` for permanent classes starts with the stable marker
    `permanent (<class>): `, which users and tests may match on.
    """

    def __init__(self, error_class: ErrorClass, message: str) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message

    @property
    def permanent(self) -> bool:
        return self.error_class is not ErrorClass.TRANSIENT

    def __str__(self) -> str:
        if self.permanent:
            return f"permanent ({self.error_class.value}): {self.message}"
        return self.message


def transient(message: str) -> DriverError:
    return DriverError(ErrorClass.TRANSIENT, message)


def invalid_config(message: str) -> DriverError:
    return DriverError(ErrorClass.INVALID_CONFIG, message)


def device_failed(message: str) -> DriverError:
    return DriverError(ErrorClass.DEVICE_FAILED, message)


def parse_permanent_errors(value: str) -> frozenset[ErrorClass]:
    """`--permanent-errors invalid-config,device-failed` -> the set of classes; ''
    means none. Raises ValueError naming an unknown or transient class."""
    classes: set[ErrorClass] = set()
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            cls = ErrorClass(part)
        except ValueError:
            raise ValueError(
                f"unknown error class {part!r} (known: invalid-config, device-failed)"
            ) from None
        if cls is ErrorClass.TRANSIENT:
            raise ValueError("transient is not a permanent error class")
        classes.add(cls)
    return frozenset(classes)
