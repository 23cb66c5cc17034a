"""The webhook's TLS under GitOps: `helm template` has no cluster, so the chart-generated
certificate is new at every render; a Secret the user provides renders the same each time."""

from __future__ import annotations

import base64

import yaml
from test_chart_render import Doc, helm_template, one

CA_BUNDLE = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
USER_SECRET = (
    "--set",
    "webhook.tls.existingSecret=corp-webhook-tls",
    "--set",
    f"webhook.tls.caBundle={CA_BUNDLE.decode()}",
)


def test_a_user_provided_secret_renders_the_same_every_time() -> None:
    first = helm_template(*USER_SECRET).stdout
    assert helm_template(*USER_SECRET).stdout == first
    docs: list[Doc] = [d for d in yaml.safe_load_all(first) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]
    deployment = one(docs, "Deployment", "webhook")
    secrets = [v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"]]
    assert secrets == ["corp-webhook-tls"]
    webhook = one(docs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert webhook["clientConfig"]["caBundle"] == CA_BUNDLE.decode()


def test_a_user_provided_secret_needs_its_ca_bundle() -> None:
    proc = helm_template("--set", "webhook.tls.existingSecret=corp-webhook-tls", check=False)
    assert proc.returncode != 0
    assert "webhook.tls.caBundle" in proc.stderr
