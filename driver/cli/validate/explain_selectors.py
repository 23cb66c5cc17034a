"""The selectors of one request as `gpu-dra validate --explain` (driver/cli/validate/explain.py)
evaluates them, device by device, under two cost budgets (driver/cli/validate/cel_cost.py):

* each evaluation, on one device, may cost COST_LIMIT, Kubernetes' own runtime limit
  for a device selector: the scheduler stops a selector there too, and its allocation
  fails with that error;
* all the evaluations of one selector for one request may cost TOTAL_LIMIT together,
  this tool's own bound (not Kubernetes'): celpy spends some 10 to 100 microseconds per
  cost unit, so a selector that stays just under the limit on each of hundreds of
  devices would otherwise run for hours.

A selector that passes either budget is stopped: the device it was evaluated on and
every later device that reaches it are excluded by it as by an error ("not evaluated"),
and `stopped_line` says which selector was stopped, after how many devices, and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.cli.validate.cel_cost import COST_LIMIT
from driver.cli.validate.cel_device import CelBudgetExceeded, CelError, Selector

#: This tool's bound on the cost of one selector over all the devices of a request.
TOTAL_LIMIT = 10 * COST_LIMIT
NOT_EVALUATED = "not evaluated: the selector was stopped at its CEL cost budget"
SHOWN = 60  # characters of a stopped selector's expression shown


@dataclass
class SelectorRun:
    """One selector of a request (`label`: where it comes from, `expression`), compiled
    or not, and what evaluating it has cost so far."""

    label: str
    expression: str
    selector: Selector | CelError
    devices: int = 0  # evaluated on
    total: int = 0  # cost of those evaluations
    stopped: str = ""  # why it was stopped, and on which device

    @classmethod
    def compile(cls, label: str, expression: str) -> SelectorRun:
        try:
            return cls(label, expression, Selector(expression))
        except CelError as err:
            return cls(label, expression, err)

    @property
    def where(self) -> str:
        """The selector as the summary and the device lines name it."""
        return f"{self.label} {self.expression!r}"

    def verdict(self, activation: dict[str, object], device: str) -> tuple[str, str, str] | None:
        """None where the selector is true on the device; else its exclusion's kind
        (`false` or `error`), reason and line (after `excluded by`)."""
        selector = self.selector
        if isinstance(selector, CelError):
            return "error", str(selector), f"{self.where}: {selector}"
        if self.stopped:
            return "error", NOT_EVALUATED, f"{self.where}: error: {NOT_EVALUATED}"
        self.devices += 1
        try:
            matched = selector.matches(activation, min(COST_LIMIT, TOTAL_LIMIT - self.total))
        except CelBudgetExceeded as err:
            self.total += selector.last_cost
            why = self._stop(err.limit, device)
            return "error", why, f"{self.where}: error: {why}"
        except CelError as err:
            self.total += selector.last_cost
            return "error", str(err), f"{self.where}: error: {err}"
        self.total += selector.last_cost
        return None if matched else ("false", "false", f"{self.where} (false)")

    def _stop(self, limit: int, device: str) -> str:
        """Stops the selector; returns why."""
        if limit == COST_LIMIT:
            why = f"CEL cost budget ({COST_LIMIT}) exceeded"
        else:
            why = f"total CEL cost budget of the request's devices ({TOTAL_LIMIT}) exceeded"
        self.stopped = f"{why} after {self.devices} device(s), on {device}"
        return why

    def stopped_line(self, request: str) -> str | None:
        """The line that names the selector, if it was stopped, and why."""
        if not self.stopped:
            return None
        shown = self.expression
        if len(shown) > SHOWN:
            shown = shown[: SHOWN - 3] + "..."
        return (
            f"  request {request}: selector {self.label} {shown!r} stopped: {self.stopped}"
            "; the devices after it are excluded by it without evaluating it"
        )
