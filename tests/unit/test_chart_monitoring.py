"""The chart's PrometheusRule: off by default, the alerts docs/operations.md documents,
on metrics the plugin really exposes."""

from __future__ import annotations

import re
import subprocess

from prometheus_client import Metric
from test_chart_render import CHART, NAMESPACE, REPO, Doc, find_helm, helm_template, one, render

from driver.observability import metrics

RULE = "kubeletPlugin.metrics.prometheusRule"


def exposed_series() -> set[str]:
    """Names of the series the plugin's /metrics can carry, by metric type."""
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    families: list[Metric] = list(metrics.REGISTRY.collect())
    return {f.name + suffix for f in families for suffix in suffixes[f.type]}


def documented_alerts() -> dict[str, tuple[str, str]]:
    """Alert name -> (expression, for) from the alert table of docs/operations.md."""
    doc = (REPO / "docs" / "operations.md").read_text()
    table = doc.split("## What to alert on", 1)[1].split("\n\n", 2)[1]
    alerts = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        name, expr, duration = cells[0].strip("`"), cells[1].strip("`"), cells[2]
        alerts[name] = (expr.replace("\\|", "|"), "" if duration == "—" else duration)
    return alerts


def rule_alerts(rule: Doc) -> dict[str, Doc]:
    (group,) = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_no_prometheus_rule_by_default() -> None:
    assert [d for d in render() if d["kind"] == "PrometheusRule"] == []


def test_enabled_rule_has_the_documented_alerts() -> None:
    docs = render("--set", f"{RULE}.enabled=true", "--set", f"{RULE}.labels.release=prometheus")
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "gpu-dra-driver-kubeletplugin"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = rule_alerts(rule)
    documented = documented_alerts()
    assert len(documented) >= 8
    assert {name: (r["expr"], r.get("for", "")) for name, r in alerts.items()} == documented
    for name, r in alerts.items():
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        # Prometheus' own templating is passed through, not evaluated by helm.
        assert "{{" not in r["annotations"]["description"], name


def test_alerts_name_only_metrics_the_plugin_exposes() -> None:
    rule = one(render("--set", f"{RULE}.enabled=true"), "PrometheusRule")
    exposed = exposed_series()
    for name, alert in rule_alerts(rule).items():
        used = set(re.findall(r"\bgpu_dra_\w+", alert["expr"]))
        assert used, f"{name} reads no plugin metric"
        assert used <= exposed, f"{name}: {sorted(used - exposed)} not exposed by the plugin"


def test_enabled_rule_lints_and_bad_values_are_rejected() -> None:
    lint = [find_helm(), "lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    proc = subprocess.run(
        [*lint, "--set", f"{RULE}.enabled=true"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and "[WARNING]" not in proc.stdout, proc.stdout + proc.stderr
    for bad in [f"{RULE}.enable=true", f"{RULE}.enabled=yes", f"{RULE}.labels=x"]:
        failed = helm_template("--set", bad, check=False)
        assert failed.returncode != 0, bad
        assert "prometheusRule" in failed.stderr, failed.stderr
