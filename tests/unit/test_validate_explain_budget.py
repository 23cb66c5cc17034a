"""`gpu-dra validate --explain` evaluates each CEL selector under DRA's runtime cost
limit (1,000,000 per evaluation): a selector that exceeds it on a device is stopped
there, named in one line, and counted as a selector error on the devices it would have
seen; the rest of the report goes on. Before the limit, the selectors below ran for
hours (one of 252 characters took about 7 hours)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from driver.cli.validate import explain_selectors
from driver.cli.validate.cel_device import CelError, Selector, device_activation
from tests.unit.test_validate_cli import run_cli
from tests.unit.test_validate_explain import DRIVER, _mig_slices

# Bounded by pytest-timeout: without the budget these run for hours.
pytestmark = pytest.mark.timeout(60)

TEN = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"


def _nested(body: str, names: str = "abcdef") -> str:
    """`TEN.all(a, TEN.all(b, ... body))`: the body is evaluated 10**len(names) times."""
    for name in reversed(names):
        body = f"{TEN}.all({name}, {body})"
    return body


# Exponential string growth and nested macros: the driver's name doubled ten times (15
# KiB), then a million evaluations of a body that searches it: about a millisecond
# each with cel-python, so hours per device; its CEL cost passes 1,000,000 after some
# 600 of them.
SLOW = _nested("s10.contains(device.driver) || a + b + c + d + e + f >= 0")
for _i in reversed(range(10)):
    SLOW = f"[s{_i} + s{_i}].all(s{_i + 1}, {SLOW})"
SLOW = f"[device.driver].all(s0, {SLOW})"


def _claim(tmp_path: Path) -> Path:
    requests = [
        {
            "name": "slow",
            "exactly": {
                "deviceClassName": f"mig.{DRIVER}",
                "selectors": [
                    {"cel": {"expression": f"device.driver == '{DRIVER}'"}},
                    {"cel": {"expression": SLOW}},
                ],
            },
        },
        {"name": "fine", "exactly": {"deviceClassName": f"mig.{DRIVER}"}},
    ]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "budget", "namespace": "default"},
        "spec": {"devices": {"requests": requests}},
    }
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(claim))
    return path


def test_a_selector_over_the_cost_budget_is_stopped_and_the_report_goes_on(
    tmp_path: Path,
) -> None:
    slices = str(_mig_slices(tmp_path))
    claim = str(_claim(tmp_path))
    code, out, err = run_cli("--explain", claim, "--slices", slices, "--devices")
    assert code == 1
    assert "1 request(s) cannot be allocated" in err
    lines = out.splitlines()
    # One line names the stopped selector (its text shortened) and why.
    stopped = [x for x in lines if x.startswith("  request slow: selector ")]
    assert len(stopped) == 1, out
    assert stopped[0].startswith(
        "  request slow: selector spec.devices.requests[0].exactly.selectors[1] "
        "'[device.driver].all(s0, [s0 + s0].all(s1, [s1 + s1].all(s...'"
    )
    assert stopped[0].endswith(
        "' stopped: CEL cost budget (1000000) exceeded after 1 device(s), on "
        "gpu-0-mig-1g10gb-0 on node-a; the devices after it are excluded by it without "
        "evaluating it"
    )
    slow = next(x for x in lines if x.startswith("ResourceClaim/budget: request slow "))
    assert slow.endswith(" needed: CANNOT ALLOCATE")
    # Every device that reached the selector is excluded by it, as by an error.
    where = "  spec.devices.requests[0].exactly.selectors[1] "
    summary = next(x for x in lines if x.startswith(where))
    seen = int(summary.split("excluded ")[1].split()[0])
    assert seen > 1
    assert summary.endswith(
        f"excluded {seen} of {seen} device(s): {seen} error(s): not evaluated: the selector "
        f"was stopped at its CEL cost budget ({seen - 1}); CEL cost budget (1000000) "
        "exceeded (1)"
    )
    # --devices: the first device names the budget, the others the stopped selector.
    excluded = [x for x in lines if " on node-a: excluded by spec.devices.requests[0]" in x]
    assert len(excluded) == seen
    assert excluded[0].endswith(": error: CEL cost budget (1000000) exceeded")
    assert all(
        x.endswith(": error: not evaluated: the selector was stopped at its CEL cost budget")
        for x in excluded[1:]
    )
    # The other request is explained as usual.
    fine = next(x for x in lines if x.startswith("ResourceClaim/budget: request fine "))
    assert fine.endswith(": enough")


def test_the_cost_counts_operations_and_the_size_of_what_they_touch() -> None:
    activation = device_activation(
        {"name": "d", "attributes": {"profile": {"string": "a"}}}, DRIVER
    )
    plain = Selector(f"device.driver == '{DRIVER}' && 'profile' in device.attributes['{DRIVER}']")
    assert plain.matches(activation)
    assert 0 < plain.last_cost < 100
    # The shape of the 7-hour selector, nested macros (a million evaluations of the
    # body), under a smaller budget: celpy spends the full one in about a minute.
    nested = Selector(_nested("a + b + c + d + e + f >= 0"), budget=10_000)
    with pytest.raises(CelError, match=r"^CEL cost budget \(10000\) exceeded$"):
        nested.matches(activation)
    assert nested.last_cost == 10_001
    # Exponential string growth, 26 doublings: few operations, but each is charged one
    # unit per ten characters it copies, so the budget stops it near 2**23 characters.
    names = "abcdefghijklmnopqrstuvwxyz"
    body = f"size({names[-1]}) > 0"
    for before, name in reversed(list(itertools.pairwise(names))):
        body = f"[{before} + {before}].all({name}, {body})"
    grow = Selector(f"['x'].all({names[0]}, {body})")
    with pytest.raises(CelError, match=r"^CEL cost budget \(1000000\) exceeded$"):
        grow.matches(activation)
    # The Selector is usable again: each evaluation has its own budget.
    assert plain.matches(activation)


def test_a_selector_is_stopped_when_its_evaluations_together_pass_the_total(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This tool's own bound on one selector over a request's devices, made small here.
    monkeypatch.setattr(explain_selectors, "TOTAL_LIMIT", 100)
    activation = device_activation({"name": "d"}, DRIVER)
    run = explain_selectors.SelectorRun.compile("selector[0]", f"device.driver == '{DRIVER}'")
    verdicts = [run.verdict(activation, f"d{n}") for n in range(40)]
    stopped = verdicts.index(next(v for v in verdicts if v is not None))
    assert 1 < stopped < 40 and not any(verdicts[:stopped])
    why = "total CEL cost budget of the request's devices (100) exceeded"
    assert verdicts[stopped] == ("error", why, f"selector[0] {run.expression!r}: error: {why}")
    assert all(v is not None and v[1].startswith("not evaluated") for v in verdicts[stopped + 1 :])
    assert run.stopped_line("gpu") == (
        f"  request gpu: selector selector[0] {run.expression!r} stopped: {why} after "
        f"{stopped + 1} device(s), on d{stopped}; the devices after it are excluded by it "
        "without evaluating it"
    )
