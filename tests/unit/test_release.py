"""Release basics: a license the package metadata and the image labels agree on, one
version for the package, the chart's appVersion, the image tag the chart defaults to and
the tags the install commands name, and a changelog with a section for that version."""

from __future__ import annotations

import re
import subprocess
import tomllib

import yaml
from test_chart_render import CHART, REPO, render

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?$")
# Where the install commands name a tag of the driver image.
INSTALL_DOCS = (
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    CHART / "README.md",
)
VERSIONED_IMAGE = re.compile(r"gpu-dra-driver:(\d+\.\d+\.\d+[\w.-]*)")


def test_the_license_is_apache_2_and_everything_says_so() -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text.splitlines()[1]
    assert "Version 2.0, January 2004" in license_text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in license_text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"  # an SPDX expression
    dockerfile = (REPO / "deployments" / "container" / "Dockerfile").read_text()
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in dockerfile
    build_image = (REPO / "hack" / "build-image.sh").read_text()
    assert '"org.opencontainers.image.licenses": "Apache-2.0"' in build_image


def test_the_package_version_is_the_charts_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert SEMVER.match(VERSION), VERSION
    assert str(chart["appVersion"]) == VERSION
    assert SEMVER.match(str(chart["version"])), "the chart's own version is semver too"


def test_the_image_build_tags_the_package_version_by_default() -> None:
    """hack/build-image.sh without --tag builds the image the chart runs by default."""
    script = (REPO / "hack" / "build-image.sh").read_text().splitlines()
    (default,) = [line for line in script if line.startswith("TAG=")]
    shell = f'REPO_DIR="{REPO}"; {default}; printf %s "$TAG"'
    tag = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    assert tag.stdout == f"gpu-dra-driver:{VERSION}"


def test_the_chart_runs_the_image_of_the_package_version_by_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] in ("", VERSION), "empty: the chart's appVersion"
    images = {
        container["image"]
        for doc in render()
        if doc["kind"] in ("DaemonSet", "Deployment")
        for container in doc["spec"]["template"]["spec"].get("initContainers", [])
        + doc["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"{values['image']['repository']}:{VERSION}"}


def test_every_documented_release_tag_is_the_package_version() -> None:
    named = {
        (doc.relative_to(REPO).as_posix(), tag)
        for doc in INSTALL_DOCS
        for tag in VERSIONED_IMAGE.findall(doc.read_text())
    }
    assert named, "the install commands name a versioned image"
    assert {tag for _, tag in named} == {VERSION}, sorted(named)


def test_the_changelog_has_an_unreleased_section_and_one_for_this_version() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert "[Keep a Changelog]" in changelog
    sections = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert sections[0] == "Unreleased", sections
    assert VERSION in sections, f"no section for {VERSION}: {sections}"
    released = [s for s in sections if s != "Unreleased"]
    assert all(SEMVER.match(s) for s in released), released
    keys = [tuple(int(p) for p in s.split("-")[0].split(".")) for s in released]
    assert keys == sorted(keys, reverse=True), "newest release first"
