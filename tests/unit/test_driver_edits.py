"""The driver's CDI edits: the generator's output read strictly, its failures in one
line, the driver-version check that decides when the common spec is regenerated, and
what a prepare does while the driver cannot be read. (The comparison with NVIDIA's
nvidia-ctk is in tests/integration/test_cdi_generator.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.cdi.claim_specs import CdiSpecs
from driver.cdi.common_spec import CommonSpec
from driver.cdi.driver_edits import (
    DriverEdits,
    DriverEditsError,
    DriverRoot,
    generate,
    parse_generator_output,
)
from driver.errors import DriverError

PROC_DEVICES = Path(__file__).parent / "data" / "proc-devices"
LIBS = "/usr/lib/x86_64-linux-gnu"


def fake_generator(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "gpu-dra-cdi-common"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def output(version: str, lib_dir: str = LIBS) -> str:
    edits = {
        "env": [f"NVIDIA_CTK_LIBCUDA_DIR={lib_dir}", "NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": "/dev/nvidiactl"}],
        "mounts": [
            {
                "hostPath": f"{lib_dir}/libcuda.so.{version}",
                "containerPath": f"{LIBS}/libcuda.so.{version}",
                "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
            }
        ],
        "hooks": [{"hookName": "createContainer", "path": "/h", "args": ["nvidia-cdi-hook"]}],
    }
    return json.dumps({"driverVersion": version, "containerEdits": edits})


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("not json", "printed no JSON"),
        ("[]", "not an object"),
        ('{"containerEdits": {}}', "no driverVersion"),
        ('{"driverVersion": "1.2", "containerEdits": []}', "containerEdits must be an object"),
        ('{"driverVersion": "1.2", "containerEdits": {"mounts": {"a": 1}}}', "mounts must be"),
    ],
)
def test_bad_generator_output_is_named(raw: str, why: str) -> None:
    with pytest.raises(DriverEditsError, match=why):
        parse_generator_output(raw)


def test_the_generators_device_nodes_are_dropped() -> None:
    edits = parse_generator_output(output("580.95.05"))
    assert set(edits.edits) == {"env", "mounts", "hooks"}  # nodes come from /proc/devices


def test_a_failing_generator_is_one_line_with_its_last_words(tmp_path: Path) -> None:
    generator = fake_generator(
        tmp_path, "echo noise >&2; echo 'libcuda.so.*.*: not found' >&2; exit 1"
    )
    root = DriverRoot(tmp_path, Path("/"), "/h")
    with pytest.raises(DriverEditsError) as info:
        generate(root, generator)
    assert str(info.value) == (
        f"gpu-dra-cdi-common for driver root {tmp_path}: libcuda.so.*.*: not found"
    )


@pytest.mark.parametrize("host", ["/", "/run/nvidia/driver"])
def test_the_version_check_looks_in_this_processes_view_of_the_root(
    tmp_path: Path, host: str
) -> None:
    host_dir = f"{host.rstrip('/')}{LIBS}"
    edits = parse_generator_output(output("580.95.05", host_dir))
    root = DriverRoot(tmp_path, Path(host), "/h")
    libcuda = tmp_path / LIBS.lstrip("/") / "libcuda.so.580.95.05"
    assert edits.libcuda_paths(root) == [libcuda]
    assert not edits.is_current(root)
    libcuda.parent.mkdir(parents=True)
    libcuda.write_text("")
    assert edits.is_current(root)
    assert not DriverEdits("580.95.05", {}).is_current(root)  # nothing to check: regenerate


def test_prepare_fails_transiently_while_the_driver_cannot_be_read(tmp_path: Path) -> None:
    """A driver container not up yet: the start writes the names only and logs; a prepare
    then refreshes and fails with the reason; once the driver is there it succeeds."""
    generator = fake_generator(tmp_path, "echo 'no driver yet' >&2; exit 1")
    specs = CdiSpecs(tmp_path / "cdi", "gpu.example.com")
    root = DriverRoot(tmp_path / "driver", Path("/"), "/h")
    common = CommonSpec(specs, "n", root, proc_devices=PROC_DEVICES, generator=generator)
    common.write()
    doc = json.loads(specs.common_spec_path.read_text())
    assert "mounts" not in doc["devices"][0]["containerEdits"]
    with pytest.raises(DriverError, match="no driver yet") as info:
        common.refresh()
    assert not info.value.permanent
    generator.write_text(f"#!/bin/sh\necho '{output('580.95.05')}'\n")
    lib = tmp_path / "driver" / LIBS.lstrip("/") / "libcuda.so.580.95.05"
    lib.parent.mkdir(parents=True)
    lib.write_text("")
    common.refresh()
    edits = json.loads(specs.common_spec_path.read_text())["devices"][0]["containerEdits"]
    assert edits["mounts"][0]["containerPath"].endswith("libcuda.so.580.95.05")
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert common.problem is None
