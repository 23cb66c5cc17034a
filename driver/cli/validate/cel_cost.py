"""A cost budget for one CEL evaluation on cel-python (`celpy`), modelled on the runtime
cost limit Kubernetes puts on DRA device selectors (driver/cli/validate/cel_device.py uses it;
`gpu-dra validate --explain` reports the selectors it stops).

Why a cost count, and not a clock: celpy has no cost tracker, but it has the hooks for
one. Its interpreter (`celpy.evaluation.Evaluator`) visits the parse tree node by node
and builds every macro's nested evaluator through `sub_evaluator`, so a subclass sees
each step the evaluation takes; and operators and functions are looked up by name
(`_+_`, `_==_`, `contains`, ...) in the functions a program is given, so wrapping them
sees the values they work on. The count raises `CostLimitExceeded` inside the step that
crosses the limit, which unwinds the evaluation then and there: nothing keeps running
after the report. A time budget would need a child process per evaluation (slow for
hundreds of devices, and its verdict would depend on the machine's load) or a thread,
which Python cannot stop. A static estimate before evaluation, as the API server makes,
needs a type checker that celpy lacks. The count is deterministic: the same selector on
the same device is stopped at the same step on every machine.

The units follow cel-go's runtime cost, roughly: each evaluated operation (operator,
function or method call, identifier, field or index access, macro step) costs 1;
literals (constants, parsed once) and the parse tree's single-child nodes, which only
pass a value up, cost nothing; an operator or function also costs one unit per ten
characters or elements of the strings, bytes, lists and maps it is given (nested ones
counted too), as cel-go charges 0.1 per character or element it traverses. Regular
expressions are RE2 in celpy, linear in their input, so `matches` is charged like
`contains`. So no step runs long unpaid: exponential string growth is stopped by the
lengths it copies, nested macros by their steps. A unit takes celpy some 10 to 100
microseconds (cel-go: nanoseconds), so the full budget is spent in up to about a
minute: six nested macros over ten-element lists (260 characters, hours per device
before) are stopped after about 60 seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import Evaluator

#: Kubernetes' runtime cost limit for one evaluation of a DRA device selector
#: (resource.k8s.io `CELSelectorExpressionMaxCost`, 1,000,000 CEL cost units). The API
#: server also rejects a selector whose estimated worst-case cost exceeds it.
COST_LIMIT = 1_000_000

# celpy's operators and functions whose work grows with the size of their arguments.
SIZED = (
    "_+_",
    "_==_",
    "_!=_",
    "_<_",
    "_<=_",
    "_>_",
    "_>=_",
    "_in_",
    "contains",
    "startsWith",
    "endsWith",
    "matches",
)
_SIZED_TYPES = (str, bytes, list, dict)  # celtypes' String, Bytes, List and MapType
# The children of a `primary` parse node that look up a name: a variable or a function.
_NAMES = frozenset({"ident", "dot_ident", "ident_arg", "dot_ident_arg"})


class CostLimitExceeded(Exception):
    """The evaluation's cost passed its limit; the evaluation was stopped."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"CEL cost budget ({limit}) exceeded")
        self.limit = limit


class Meter:
    """The cost of the evaluation under way, against `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cost = 0

    def charge(self, units: int) -> None:
        self.cost += units
        if self.cost > self.limit:
            raise CostLimitExceeded(self.limit)

    def charge_sizes(self, values: tuple[Any, ...]) -> None:
        """One unit per ten characters or elements of `values`, nested ones included;
        counting stops where the budget would be spent, so it costs no more than that."""
        cap = (self.limit - self.cost + 1) * 10
        size = 0
        pending = [v for v in values if isinstance(v, _SIZED_TYPES)]
        while pending and size <= cap:
            value = pending.pop()
            size += len(value)
            if isinstance(value, list):
                pending += [v for v in value if isinstance(v, _SIZED_TYPES)]
            elif isinstance(value, dict):
                pending += [v for v in value if isinstance(v, _SIZED_TYPES)]
                pending += [v for v in value.values() if isinstance(v, _SIZED_TYPES)]
        if size:
            self.charge(-(-size // 10))


def metered_functions(
    functions: Mapping[str, Callable[..., Any]], meter: Meter
) -> dict[str, Callable[..., Any]]:
    """`functions` and celpy's SIZED built-ins, each charging `meter` for the size of
    its arguments before it runs (the call itself is charged as a step)."""
    base = celpy.evaluation.base_functions
    chosen = {name: base[name] for name in SIZED} | dict(functions)
    return {name: _charging(function, meter, name) for name, function in chosen.items()}


def _charging(function: Callable[..., Any], meter: Meter, name: str) -> Callable[..., Any]:
    @wraps(function)
    def call(*args: Any) -> Any:
        if name == "_in_" and len(args) == 2 and not isinstance(args[1], list):
            meter.charge_sizes(args[:1])  # a map's key lookup does not traverse the map
        else:
            meter.charge_sizes(args)
        return function(*args)

    return call


class _MeteredEvaluator(Evaluator):
    """celpy's interpreter, charging `meter` for each step; macros' nested evaluators
    share the meter. A literal is parsed once (celpy would parse it on every visit, in
    time that grows with its length) and then costs nothing, as a constant in cel-go."""

    def __init__(
        self, ast: lark.Tree, activation: Any, meter: Meter, constants: dict[int, Any]
    ) -> None:
        super().__init__(ast, activation)
        self.meter = meter
        self.constants = constants  # id() of a literal's parse node -> its value

    def evaluate(self, context: Any = None) -> celtypes.Value:
        self.meter.charge(1)  # the evaluation, or one step of a macro
        return super().evaluate(context)

    def visit(self, tree: lark.Tree) -> Any:
        children = tree.children
        if len(children) != 1:
            self.meter.charge(1)  # an operator, a call's arguments, a field or an index
        elif isinstance(children[0], lark.Tree):
            if tree.data == "primary" and children[0].data in _NAMES:
                self.meter.charge(1)  # a variable, or a function call
        elif tree.data != "literal":
            self.meter.charge(1)
        return super().visit(tree)

    def visit_children(self, tree: lark.Tree) -> list[Any]:
        # lark's own visit_children bypasses visit(): every child goes through it here.
        self.level += 1
        try:
            return [self.visit(c) if isinstance(c, lark.Tree) else c for c in tree.children]
        finally:
            self.level -= 1

    def literal(self, tree: lark.Tree) -> Any:
        key = id(tree)  # the parse tree lives as long as the program: ids stay unique
        if key not in self.constants:
            self.constants[key] = super().literal(tree)
        return self.constants[key]

    def sub_evaluator(self, ast: lark.Tree) -> Evaluator:
        return _MeteredEvaluator(ast, self.activation, self.meter, self.constants)


class MeteredRunner(celpy.InterpretedRunner):
    """A compiled expression whose every evaluation starts `meter` afresh."""

    def __init__(
        self,
        environment: celpy.Environment,
        ast: lark.Tree,
        functions: Mapping[str, Callable[..., Any]],
        meter: Meter,
    ) -> None:
        super().__init__(environment, ast, metered_functions(functions, meter))
        self.meter = meter
        self.constants: dict[int, Any] = {}

    def evaluate(self, context: Any) -> celtypes.Value:
        self.meter.cost = 0
        evaluator = _MeteredEvaluator(self.ast, self.new_activation(), self.meter, self.constants)
        return evaluator.evaluate(context)
