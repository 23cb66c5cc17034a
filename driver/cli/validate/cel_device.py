"""DRA's CEL environment for device selectors, offline (`gpu-dra validate --explain`),
on cel-python (module `celpy`).

What a selector sees, as the scheduler builds it (k8s.io/dynamic-resource-allocation/
cel): `device.driver`; `device.attributes[domain][id]` and `device.capacity[domain]
[id]`, where an attribute or capacity name without a domain (`profile`) is in the
driver's domain and one with it (`resource.kubernetes.io/pcieRoot`) in its own; a
domain the device has nothing in reads as an empty map (so `'x' in
device.attributes["other.io"]` is false), while a missing id in a domain is an
evaluation error. `device.allowMultipleAllocations` is the device's flag.

celpy lacks Kubernetes' CEL libraries; the two selectors use are registered as
functions: quantities (`quantity("10Gi")`, `isQuantity`, `q.compareTo(q2)`,
`isGreaterThan`, `isLessThan`, `sign`, `isInteger`, `asInteger`,
`asApproximateFloat`, `add`, `sub`) and semantic versions (`semver("1.2.3")`,
`isSemver`, `v.major()`, `minor`, `patch`, `compareTo`, `isGreaterThan`,
`isLessThan`). Capacity values are quantities, `version` attributes semvers. Not
supported: `cel.bind` (the expression then fails to compile, and says so).

Each evaluation runs under DRA's runtime CEL cost limit (driver/cli/validate/cel_cost.py): one
that passes it is stopped and raises CelBudgetExceeded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import total_ordering
from typing import Any

import celpy
from celpy import celtypes

from driver.cli.validate.cel_cost import COST_LIMIT, CostLimitExceeded, Meter, MeteredRunner
from driver.devices.formatting import parse_quantity

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$"
)


class CelError(Exception):
    """A selector that does not compile or cannot be evaluated on a device."""


class CelBudgetExceeded(CelError):
    """An evaluation passed its CEL cost budget (`limit`) and was stopped."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"CEL cost budget ({limit}) exceeded")
        self.limit = limit


@total_ordering
@dataclass(frozen=True)
class Quantity:
    """A Kubernetes resource quantity (`10Gi`, `500m`), exact."""

    value: Decimal

    def __lt__(self, other: Quantity) -> bool:
        return self.value < other.value


@dataclass(frozen=True)
class Semver:
    """A semantic version; `pre` ordered as SemVer 2.0 says (build metadata ignored)."""

    major: int
    minor: int
    patch: int
    pre: tuple[str, ...] = ()

    def key(self) -> tuple[Any, ...]:
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, not self.pre, pre)


def parse_semver(text: str) -> Semver:
    match = _SEMVER.match(text)
    if match is None:
        raise ValueError(f"not a semantic version: {text!r}")
    major, minor, patch, pre = match.groups()
    return Semver(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else ())


def _quantity(text: object) -> Quantity:
    try:
        return Quantity(parse_quantity(str(text)))
    except (ValueError, TypeError) as err:
        raise CelError(f"quantity('{text}'): {err}") from None


def _semver(text: object) -> Semver:
    try:
        return parse_semver(str(text))
    except ValueError as err:
        raise CelError(f"semver: {err}") from None


def _valid(parse: Callable[[object], object]) -> Callable[[object], celtypes.BoolType]:
    def check(text: object) -> celtypes.BoolType:
        try:
            parse(text)
        except CelError:
            return celtypes.BoolType(False)
        return celtypes.BoolType(True)

    return check


def _compare(a: object, b: object) -> int:
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return (a.value > b.value) - (a.value < b.value)
    if isinstance(a, Semver) and isinstance(b, Semver):
        return (a.key() > b.key()) - (a.key() < b.key())
    raise CelError(f"compareTo: no overload for {type(a).__name__}, {type(b).__name__}")


def _as_quantity(value: object, function: str) -> Quantity:
    if isinstance(value, Quantity):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Quantity(Decimal(value))
    raise CelError(f"{function}: a quantity or an int is needed, not {type(value).__name__}")


def _version_part(index: int) -> Callable[[object], celtypes.IntType]:
    def part(version: object) -> celtypes.IntType:
        if not isinstance(version, Semver):
            raise CelError(f"not a semver: {version!r}")
        return celtypes.IntType((version.major, version.minor, version.patch)[index])

    return part


def _quantity_only(function: str, value: object) -> Quantity:
    if not isinstance(value, Quantity):
        raise CelError(f"{function}: not a quantity: {value!r}")
    return value


def _as_integer(q: object) -> celtypes.IntType:
    value = _quantity_only("asInteger", q).value
    if value != value.to_integral_value():
        raise CelError(f"asInteger: {value} is not an integer")
    return celtypes.IntType(int(value))


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _quantity,
    "isQuantity": _valid(_quantity),
    "semver": _semver,
    "isSemver": _valid(_semver),
    "compareTo": lambda a, b: celtypes.IntType(_compare(a, b)),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b) < 0),
    "major": _version_part(0),
    "minor": _version_part(1),
    "patch": _version_part(2),
    "sign": lambda q: celtypes.IntType(
        (_quantity_only("sign", q).value > 0) - (_quantity_only("sign", q).value < 0)
    ),
    "isInteger": lambda q: celtypes.BoolType(
        _quantity_only("isInteger", q).value == _quantity_only("isInteger", q).value.to_integral()
    ),
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(_quantity_only("float", q).value)),
    "add": lambda a, b: Quantity(_as_quantity(a, "add").value + _as_quantity(b, "add").value),
    "sub": lambda a, b: Quantity(_as_quantity(a, "sub").value - _as_quantity(b, "sub").value),
}


class _Domains(celtypes.MapType):
    """`device.attributes` / `device.capacity`: a domain not there reads as empty."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType({})


def _attribute_value(entry: object) -> Any:
    if not isinstance(entry, Mapping):
        raise ValueError("an attribute must be an object")
    if "bool" in entry:
        return celtypes.BoolType(bool(entry["bool"]))
    if "int" in entry:
        return celtypes.IntType(int(entry["int"]))
    if "string" in entry:
        return celtypes.StringType(str(entry["string"]))
    if "version" in entry:
        return parse_semver(str(entry["version"]))
    raise ValueError("an attribute needs bool, int, string or version")


def _by_domain(names: Mapping[str, Any], driver: str) -> _Domains:
    domains: dict[str, dict[celtypes.StringType, Any]] = {}
    for name, value in names.items():
        domain, _, ident = str(name).rpartition("/")
        domains.setdefault(domain or driver, {})[celtypes.StringType(ident)] = value
    return _Domains({celtypes.StringType(d): celtypes.MapType(ids) for d, ids in domains.items()})


def device_activation(device: Mapping[str, Any], driver: str) -> dict[str, Any]:
    """The `device` variable for one device of a ResourceSlice (v1, or v1beta1's
    `basic`). ValueError names what is malformed."""
    basic = device.get("basic")
    fields: Mapping[str, Any] = basic if isinstance(basic, Mapping) else device
    attributes = fields.get("attributes") or {}
    capacity = fields.get("capacity") or {}
    if not isinstance(attributes, Mapping) or not isinstance(capacity, Mapping):
        raise ValueError("attributes and capacity must be maps")
    values: dict[str, Any] = {}
    for name, entry in attributes.items():
        try:
            values[str(name)] = _attribute_value(entry)
        except (ValueError, TypeError) as err:
            raise ValueError(f"attribute {name}: {err}") from None
    quantities: dict[str, Any] = {}
    for name, entry in capacity.items():
        try:
            quantities[str(name)] = Quantity(parse_quantity((entry or {}).get("value")))
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"capacity {name}: {err}") from None
    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(driver),
                celtypes.StringType("attributes"): _by_domain(values, driver),
                celtypes.StringType("capacity"): _by_domain(quantities, driver),
                celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                    fields.get("allowMultipleAllocations") is True
                ),
            }
        )
    }


class Selector:
    """One compiled CEL selector expression; each evaluation may cost `budget` units
    (cel_cost.py), Kubernetes' limit unless told."""

    def __init__(self, expression: str, budget: int = COST_LIMIT) -> None:
        self.expression = expression
        self.budget = budget
        self._meter = Meter(budget)
        env = celpy.Environment()
        try:
            self._program = MeteredRunner(env, env.compile(expression), FUNCTIONS, self._meter)
        except Exception as err:  # celpy raises its parser's own error types
            raise CelError(f"does not compile: {_first_line(err)}") from None

    @property
    def last_cost(self) -> int:
        """The cost of the last evaluation (where it was stopped, if it was)."""
        return self._meter.cost

    def matches(self, activation: dict[str, Any], budget: int | None = None) -> bool:
        """Raises CelError for an evaluation error or a result that is not a bool,
        CelBudgetExceeded for one stopped at its cost budget (`budget`, if lower)."""
        self._meter.limit = self.budget if budget is None else min(budget, self.budget)
        try:
            result = self._program.evaluate(activation)
        except CostLimitExceeded as err:
            raise CelBudgetExceeded(err.limit) from None
        except CelError:
            raise
        except Exception as err:
            raise CelError(_first_line(err)) from None
        if not isinstance(result, celtypes.BoolType):
            raise CelError(f"the result is not a bool: {result!r}")
        return bool(result)


def _first_line(err: BaseException) -> str:
    text = str(err.args[0] if err.args else err).split(" (in activation", 1)[0]
    return text.splitlines()[0][:200] if text else type(err).__name__
