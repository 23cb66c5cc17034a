"""One driver image name for every GPU-less install: values-mock.yaml, hack/kind (which
builds and loads the image into the kind nodes) and the local node (hack/lib/images.sh)
must name the same image once the container runtime has normalized it, or the kubelet
looks for an image that was never loaded and tries to pull it (ErrImagePull)."""

from __future__ import annotations

import os
import subprocess

import yaml
from test_chart_render import MOCK_VALUES, REPO


def normalized(image: str) -> str:
    """The name containerd's CRI resolves `image` to (docker.io/library/ for a bare
    name, docker.io/ for a Docker Hub user's, :latest without a tag)."""
    name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    return f"{name}:{tag or 'latest'}"


def sourced(script: str, variable: str, unset: str) -> str:
    """`variable` after sourcing `script` with no override in the environment."""
    env = {k: v for k, v in os.environ.items() if k != unset}
    env["CACHE_ROOT"] = "/nonexistent"
    proc = subprocess.run(
        ["bash", "-c", f'source {script} >/dev/null; printf "%s" "${variable}"'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def test_normalized_matches_the_cri() -> None:
    assert normalized("gpu-dra-driver:dev") == "docker.io/library/gpu-dra-driver:dev"
    assert normalized("localhost/gpu-dra-driver:dev") == "localhost/gpu-dra-driver:dev"
    assert normalized("me/gpu-dra-driver") == "docker.io/me/gpu-dra-driver:latest"
    assert normalized("r.io:5000/a/b:1") == "r.io:5000/a/b:1"


def test_mock_values_kind_and_local_node_name_one_image() -> None:
    image = yaml.safe_load(MOCK_VALUES.read_text())["image"]
    mock = normalized(f"{image['repository']}:{image['tag']}")
    kind = sourced("hack/kind/common.sh", "DRIVER_IMAGE", "DRIVER_IMAGE")
    local_node = sourced("hack/lib/images.sh", "DRIVER_IMAGE_TAG", "GPU_DRA_DRIVER_IMAGE")
    assert normalized(kind) == mock
    assert normalized(local_node) == mock
    # kind names it fully qualified: Podman would store a bare name as localhost/<name>.
    assert kind == mock
    kind_readme = (REPO / "hack" / "kind" / "README.md").read_text()
    assert f"`{kind}`" in kind_readme
    assert "localhost/gpu-dra-driver" not in kind_readme
