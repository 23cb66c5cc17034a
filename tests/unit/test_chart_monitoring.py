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


MONITOR = "kubeletPlugin.metrics.serviceMonitor"


def github_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer (GitHub's rules) gives the headings."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_the_gpu_alert_fires_per_gpu_not_per_device() -> None:
    """One H100 with its MIG partitions is one failed GPU, not 26 failed devices."""
    rule = one(render("--set", f"{RULE}.enabled=true"), "PrometheusRule")
    alerts = rule_alerts(rule)
    assert "GpuDraDeviceUnhealthy" not in alerts
    gpu = alerts["GpuDraGpuUnhealthy"]
    families = {f.name: f for f in metrics.REGISTRY.collect()}
    used = set(re.findall(r"\bgpu_dra_\w+", gpu["expr"]))
    assert "gpu_dra_gpu_healthy" in used and "gpu_dra_tainted_devices" not in used
    # The series is one per GPU: its labels name the GPU, and so does the alert.
    assert {"uuid", "device"} <= set(metrics.GPU_HEALTHY._labelnames)
    assert "gpu_dra_gpu_healthy" in families
    summary = gpu["annotations"]["summary"]
    assert "$labels.device" in summary and "$labels.uuid" in summary
    assert "$value" not in summary


def test_the_gpu_alert_names_every_cause_of_an_unhealthy_gpu() -> None:
    """gpu_dra_gpu_healthy is 0 for a recorded failure and for a recovery action that
    taints the GPU (docs/health.md, "What unhealthy means"): the page says both."""
    rule = one(render("--set", f"{RULE}.enabled=true"), "PrometheusRule")
    description = rule_alerts(rule)["GpuDraGpuUnhealthy"]["annotations"]["description"]
    for cause in ("Xid", "ECC", "lost", "recovery action", "gpu-dra health clear"):
        assert cause in description, (cause, description)


def test_every_alert_links_its_runbook_section() -> None:
    anchors = github_anchors((REPO / "docs" / "operations.md").read_text())
    rule = one(render("--set", f"{RULE}.enabled=true"), "PrometheusRule")
    for name, alert in rule_alerts(rule).items():
        url = alert["annotations"]["runbook_url"]
        assert url == f"docs/operations.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/operations.md has no section {name}"
    base = "https://git.example.com/gpu-dra-driver/blob/main/"
    rule = one(
        render("--set", f"{RULE}.enabled=true", "--set", f"{RULE}.runbookBaseURL={base}"),
        "PrometheusRule",
    )
    urls = {a["annotations"]["runbook_url"] for a in rule_alerts(rule).values()}
    assert all(u.startswith(f"{base}docs/operations.md#") for u in urls), urls


def test_no_service_monitor_by_default() -> None:
    assert [d for d in render() if d["kind"] == "ServiceMonitor"] == []


def test_service_monitor_scrapes_every_plugin_pod_with_its_node() -> None:
    docs = render(
        "--set", f"{MONITOR}.enabled=true",
        "--set", f"{MONITOR}.labels.release=prometheus",
        "--set", f"{MONITOR}.interval=30s",
        "--set", "kubeletPlugin.metrics.networkPolicy.enabled=false",
    )  # fmt: skip
    monitor = one(docs, "ServiceMonitor")
    service = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")
    )
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "30s")
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    ]


def test_service_monitor_needs_prometheus_admitted_by_the_network_policy() -> None:
    """The metrics NetworkPolicy is on by default and admits no pod: a ServiceMonitor
    with it would scrape nothing, silently. Said at render time instead."""
    failed = helm_template("--set", f"{MONITOR}.enabled=true", check=False)
    assert failed.returncode != 0
    assert "serviceMonitor.enabled needs kubeletPlugin.metrics.networkPolicy.from" in failed.stderr
    peers = '[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]'
    admitted = helm_template(
        "--set", f"{MONITOR}.enabled=true",
        "--set-json", f"kubeletPlugin.metrics.networkPolicy.from={peers}",
    )  # fmt: skip
    assert "kind: ServiceMonitor" in admitted.stdout
    opted_out = helm_template(
        "--set", f"{MONITOR}.enabled=true",
        "--set", "kubeletPlugin.metrics.networkPolicy.enabled=false",
    )  # fmt: skip
    assert "kind: ServiceMonitor" in opted_out.stdout


def test_service_monitor_needs_the_metrics_service_and_valid_values() -> None:
    failed = helm_template(
        "--set", f"{MONITOR}.enabled=true",
        "--set", "kubeletPlugin.metricsService.enabled=false",
        check=False,
    )  # fmt: skip
    assert failed.returncode != 0
    assert "serviceMonitor.enabled needs kubeletPlugin.metricsService.enabled" in failed.stderr
    for bad in [
        f"{MONITOR}.enabled=yes",
        f"{MONITOR}.interval=often",
        f"{MONITOR}.scrape=true",
        f"{RULE}.runbookBaseURL=ftp://x",
    ]:
        failed = helm_template("--set", bad, check=False)
        assert failed.returncode != 0, bad
        assert "serviceMonitor" in failed.stderr or "runbookBaseURL" in failed.stderr, bad


def test_alerts_join_and_group_only_by_labels_every_scrape_adds() -> None:
    """Prometheus adds `job` and `instance` to every scraped series; `namespace` and
    `pod` come only from a ServiceMonitor or a relabelling. Joined on labels a manual
    scrape lacks, every series matches one node's corrupt health store, and
    `GpuDraGpuUnhealthy` is silenced on every node."""
    rule = one(render("--set", f"{RULE}.enabled=true"), "PrometheusRule")
    for name, alert in rule_alerts(rule).items():
        for labels in re.findall(r"\b(?:on|by)\s*\(([^)]*)\)", alert["expr"]):
            used = {label.strip() for label in labels.split(",")}
            assert used <= {"job", "instance", "le"}, (name, alert["expr"])
