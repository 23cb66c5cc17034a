"""gpu-dra-webhook registered in the real API server: invalid GpuConfigs are rejected at
creation with the field named; valid ones are admitted."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster
from tests.integration.helpers import apply, claim, delete_namespace
from tests.integration.plugin_process import DRIVER, free_port
from tests.unit.test_webhook import make_cert

NS = "webhook-test"
WEBHOOK = Path(sys.executable).parent / "gpu-dra-webhook"


def gpu_config(partition_count: object) -> dict[str, Any]:
    return {
        "apiVersion": "gpu.resource.example.com/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "SpacePartitioning",
            "spacePartitioningConfig": {"partitionCount": partition_count},
        },
    }


@pytest.fixture(scope="module")
def webhook(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    tls = tmp_path_factory.mktemp("tls")
    cert, key = make_cert(tls)
    port = free_port()
    proc = subprocess.Popen(
        [
            WEBHOOK,
            f"--tls-cert-file={cert}",
            f"--tls-private-key-file={key}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--driver-name={DRIVER}",
        ],
    )
    ca_bundle = base64.b64encode(Path(cert).read_bytes()).decode()
    url = f"https://127.0.0.1:{port}/validate-resource-claim-parameters"
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "gpu-dra-webhook-test"},
        "webhooks": [
            {
                "name": "gpuconfig.gpu.resource.example.com",
                "clientConfig": {"url": url, "caBundle": ca_bundle},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "apiVersions": ["v1", "v1beta1", "v1beta2"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["resourceclaims", "resourceclaimtemplates"],
                    }
                ],
                # Only this module's namespace: other tests must not depend on it.
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }
    try:
        ssl_context = ssl.create_default_context(cafile=cert)
        Cluster.wait_for(
            lambda: (
                urllib.request.urlopen(
                    url.replace("validate-resource-claim-parameters", "readyz"),
                    context=ssl_context,
                    timeout=1,
                ).status
                == 200
            ),
            timeout=30,
            what="webhook /readyz",
        )
        apply(
            cluster,
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            configuration,
        )
        time.sleep(2)  # the API server picks up new webhook configurations asynchronously
        yield
    finally:
        cluster.kubectl(
            "delete",
            "validatingwebhookconfiguration",
            "gpu-dra-webhook-test",
            "--ignore-not-found",
            check=False,
        )
        delete_namespace(cluster, NS)
        proc.terminate()
        proc.wait(10)


def create(cluster: Cluster, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("create", "-f", "-", input=json.dumps(doc), check=False)


def template(name: str, config: dict[str, Any]) -> dict[str, Any]:
    inner = claim(name, NS, "gpu.example.com", config=config)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"spec": inner["spec"]},
    }


def test_invalid_claim_is_rejected_naming_the_field(cluster: Cluster, webhook: None) -> None:
    rejected = create(cluster, claim("bad", NS, "gpu.example.com", config=gpu_config(0)))
    assert rejected.returncode != 0
    assert "denied the request" in rejected.stderr
    assert (
        "spec.devices.config[0].opaque.parameters.sharing.spacePartitioningConfig.partitionCount"
        in rejected.stderr
    )
    wrong_type = create(cluster, claim("bad-type", NS, "gpu.example.com", config=gpu_config("4")))
    assert wrong_type.returncode != 0 and "partitionCount" in wrong_type.stderr


def test_invalid_template_is_rejected_naming_the_field(cluster: Cluster, webhook: None) -> None:
    rejected = create(cluster, template("bad-template", gpu_config(0)))
    assert rejected.returncode != 0
    assert (
        "spec.spec.devices.config[0].opaque.parameters.sharing.spacePartitioningConfig.partitionCount"
        in rejected.stderr
    )


def test_valid_claim_and_template_are_admitted(cluster: Cluster, webhook: None) -> None:
    assert (
        create(cluster, claim("good", NS, "gpu.example.com", config=gpu_config(2))).returncode == 0
    )
    assert create(cluster, template("good-template", gpu_config(2))).returncode == 0
    names = cluster.kubectl(
        "get", "resourceclaims,resourceclaimtemplates", "-n", NS, "-o", "name"
    ).stdout.split()
    assert sorted(names) == [
        "resourceclaim.resource.k8s.io/good",
        "resourceclaimtemplate.resource.k8s.io/good-template",
    ]
