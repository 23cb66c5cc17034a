"""CDI spec files: names, contents (the reference's env vars) and atomic writes."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from driver.cdi.claim_specs import CdiDevice, CdiSpecs, ClaimSpec, cdi_device_name
from driver.cdi.device_nodes import DeviceNode
from driver.cdi.driver_edits import DriverEdits
from driver.fileio import UnsafeFileError
from driver.state.spec_render import SharingEnv, claim_device_env, device_key, gpu_env_id

UID = "11111111-2222-3333-4444-555555555555"


@pytest.fixture
def specs(tmp_path: Path) -> CdiSpecs:
    return CdiSpecs(tmp_path / "cdi", "gpu.example.com")


def test_names_follow_the_reference(specs: CdiSpecs, tmp_path: Path) -> None:
    assert specs.vendor == "k8s.gpu.example.com"
    assert specs.kind == "k8s.gpu.example.com/gpu"
    assert specs.common_spec_path == tmp_path / "cdi" / "k8s.gpu.example.com-gpu_common.json"
    assert specs.claim_spec_path(UID) == tmp_path / "cdi" / f"k8s.gpu.example.com-gpu_{UID}.json"
    assert specs.claim_spec_path("a/b").name == "k8s.gpu.example.com-gpu_a_b.json"
    # The device's own id first: the kubelet reports device health under the first id.
    assert specs.device_ids(UID, "gpu-0", None) == [
        f"k8s.gpu.example.com/gpu={UID}-gpu-0",
        "k8s.gpu.example.com/gpu=common",
    ]
    assert specs.device_ids(UID, "gpu-0", "share-1")[0] == (
        f"k8s.gpu.example.com/gpu={UID}-gpu-0-share-1"
    )
    assert cdi_device_name(UID, "gpu-0", "") == f"{UID}-gpu-0"


@pytest.mark.parametrize(
    ("name", "key", "gid"),
    [
        ("gpu-0", "GPU_0", "0"),
        ("gpu-0-partition-1", "GPU_0_PARTITION_1", "0_PARTITION_1"),
        ("gpu-3-full", "GPU_3_FULL", "3_FULL"),
        ("gpu-0-mig-1g10gb-0", "GPU_0_MIG_1G10GB_0", "0_MIG_1G10GB_0"),
    ],
)
def test_env_ids(name: str, key: str, gid: str) -> None:
    assert device_key(name) == key
    assert gpu_env_id(name) == gid


def test_default_env_matches_the_reference_example() -> None:
    env = claim_device_env(
        claim_uid=UID,
        device_name="gpu-0",
        admin_access=False,
        sharing=SharingEnv("TimeSlicing", interval="Default"),
    )
    assert env == [
        f"GPU_DEVICE_GPU_0_RESOURCE_CLAIM={UID}",
        "DRA_ADMIN_ACCESS=false",
        "GPU_DEVICE_0=gpu-0",
        "GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing",
        "GPU_DEVICE_0_TIMESLICE_INTERVAL=Default",
    ]


def test_space_partitioning_and_consumed_capacity_env() -> None:
    env = claim_device_env(
        claim_uid=UID,
        device_name="gpu-1-partition-0",
        admin_access=True,
        sharing=SharingEnv("SpacePartitioning", partition_count=4),
        consumed_capacity={"memory": "16Gi", "compute": "20"},
    )
    assert env == [
        f"GPU_DEVICE_GPU_1_PARTITION_0_RESOURCE_CLAIM={UID}",
        "DRA_ADMIN_ACCESS=true",
        "GPU_DEVICE_1_PARTITION_0=gpu-1-partition-0",
        "GPU_DEVICE_1_PARTITION_0_SHARING_STRATEGY=SpacePartitioning",
        "GPU_DEVICE_1_PARTITION_0_PARTITION_COUNT=4",
        "GPU_DEVICE_1_PARTITION_0_MEMORY=16Gi",
        "GPU_DEVICE_1_PARTITION_0_COMPUTE=20",
    ]


def test_claim_spec_is_compact_reference_json_with_mode_0600(specs: CdiSpecs) -> None:
    device = CdiDevice(f"{UID}-gpu-0", ("A=1", "B=2"))
    path = specs.write_claim_spec(UID, ClaimSpec((device,)))
    raw = path.read_bytes()
    assert raw == (
        b'{"cdiVersion":"0.5.0","kind":"k8s.gpu.example.com/gpu","devices":[{"name":"'
        + f"{UID}-gpu-0".encode()
        + b'","containerEdits":{"env":["A=1","B=2"]}}],"containerEdits":{}}'
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert specs.read_claim_spec(UID) == json.loads(raw)


def test_cdi_version_is_0_3_0_without_leading_digits(specs: CdiSpecs) -> None:
    specs.write_claim_spec("claim-a", ClaimSpec((CdiDevice("claim-a-gpu-0", ("A=1",)),)))
    assert specs.read_claim_spec("claim-a")["cdiVersion"] == "0.3.0"  # type: ignore[index]


def test_device_nodes_are_complete_char_devices(specs: CdiSpecs) -> None:
    node = DeviceNode("/dev/nvidia0", 195, 0, 0o666)
    specs.write_claim_spec("x", ClaimSpec((CdiDevice("x-gpu-0", ("A=1",), (node,)),)))
    doc = specs.read_claim_spec("x")
    assert doc is not None
    assert doc["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666}
    ]
    assert doc["containerEdits"] == {}


def test_a_journal_entry_of_an_earlier_release_renders_as_it_was(specs: CdiSpecs) -> None:
    """Path-only nodes, per device and spec-wide (control nodes), as journals of
    earlier releases hold them: the spec is rewritten byte for byte as before."""
    stored = {
        "devices": [
            {
                "name": "x-gpu-0",
                "containerEdits": {"env": ["A=1"], "deviceNodes": [{"path": "/dev/nvidia0"}]},
            }
        ],
        "deviceNodes": ["/dev/nvidiactl"],
    }
    spec = ClaimSpec.from_json(stored)
    assert spec.to_json() == stored
    specs.write_claim_spec("x", spec)
    doc = specs.read_claim_spec("x")
    assert doc is not None
    assert doc["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert doc["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidiactl"}]}


@pytest.mark.parametrize(
    ("node", "why"),
    [
        ({"path": "/dev/nvidia0", "major": "195"}, "must be integers"),
        ({"path": "/dev/nvidia0", "major": 195, "minor": 0, "type": "b"}, "type must be c"),
        ({"major": 195}, "string path"),
    ],
)
def test_bad_device_node_names_the_device(node: dict[str, object], why: str) -> None:
    doc = {"devices": [{"name": "x-gpu-0", "containerEdits": {"deviceNodes": [node]}}]}
    with pytest.raises(ValueError, match=f"x-gpu-0.*{why}"):
        ClaimSpec.from_json(doc)


def test_common_spec_with_the_driver_and_control_nodes(specs: CdiSpecs) -> None:
    mounts = [
        {
            "hostPath": "/run/nvidia/driver/usr/lib64/libcuda.so.580.95.05",
            "containerPath": "/usr/lib64/libcuda.so.580.95.05",
            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
        }
    ]
    hooks = [{"hookName": "createContainer", "path": "/opt/hook", "args": ["nvidia-cdi-hook"]}]
    driver = DriverEdits(
        "580.95.05",
        {"env": ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64"], "mounts": mounts, "hooks": hooks},
    )
    ctl = DeviceNode("/dev/nvidiactl", 195, 255, 0o666)
    doc = json.loads(specs.write_common_spec("node-a", driver, [ctl]).read_bytes())
    (common,) = doc["devices"]
    assert common["containerEdits"] == {
        "env": [
            "KUBERNETES_NODE_NAME=node-a",
            "DRA_RESOURCE_DRIVER_NAME=gpu.example.com",
            "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64",
        ],
        "deviceNodes": [ctl.to_json()],
        "mounts": mounts,
        "hooks": hooks,
    }
    assert doc["cdiVersion"] == "0.3.0"


def test_common_spec(specs: CdiSpecs) -> None:
    path = specs.write_common_spec("node-a")
    doc = json.loads(path.read_bytes())
    assert doc == {
        "cdiVersion": "0.3.0",
        "kind": "k8s.gpu.example.com/gpu",
        "devices": [
            {
                "name": "common",
                "containerEdits": {
                    "env": [
                        "KUBERNETES_NODE_NAME=node-a",
                        "DRA_RESOURCE_DRIVER_NAME=gpu.example.com",
                    ]
                },
            }
        ],
        "containerEdits": {},
    }


def test_remove_and_list(specs: CdiSpecs) -> None:
    specs.write_common_spec("node-a")
    specs.write_claim_spec("a", ClaimSpec((CdiDevice("a-gpu-0", ()),)))
    specs.write_claim_spec("b", ClaimSpec((CdiDevice("b-gpu-1", ()),)))
    (specs.root / "k8s.other.com-gpu_c.json").write_text("{}")
    (specs.root / ".k8s.gpu.example.com-gpu_d.json.tmp-abc").write_text("{")
    assert set(specs.list_claim_specs()) == {"a", "b"}
    assert specs.remove_claim_spec("a") is True
    assert specs.remove_claim_spec("a") is False
    assert set(specs.list_claim_specs()) == {"b"}
    assert specs.claim_spec_exists("b") and not specs.claim_spec_exists("a")
    assert specs.read_claim_spec("a") is None


def test_failed_rename_keeps_old_content_and_leaves_no_temp_file(
    specs: CdiSpecs, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs.write_claim_spec("a", ClaimSpec((CdiDevice("a-gpu-0", ("OLD=1",)),)))
    before = specs.claim_spec_path("a").read_bytes()

    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        specs.write_claim_spec("a", ClaimSpec((CdiDevice("a-gpu-0", ("NEW=1",)),)))
    assert specs.claim_spec_path("a").read_bytes() == before
    assert sorted(os.listdir(specs.root)) == ["k8s.gpu.example.com-gpu_a.json"]


def test_sweep_removes_only_this_drivers_temp_files(specs: CdiSpecs) -> None:
    specs.root.mkdir(parents=True)
    mine = specs.root / ".k8s.gpu.example.com-gpu_a.json.tmp-0123"
    other = specs.root / ".k8s.other.com-gpu_a.json.tmp-0123"
    mine.write_text("{")
    other.write_text("{")
    assert specs.sweep_temp_files() == [mine]
    assert not mine.exists() and other.exists()


def test_unknown_failpoint_name_is_rejected(specs: CdiSpecs) -> None:
    with pytest.raises(ValueError, match="unknown failpoint"):
        specs.write_claim_spec(
            "a", ClaimSpec((CdiDevice("a-gpu-0", ()),)), before_rename="no-such-point"
        )
    assert specs.list_claim_specs() == {}


class FsyncSpy:
    """Counts fsyncs of directories and of files."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dirs = 0
        self.files = 0
        real = os.fsync

        def counting(fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                self.dirs += 1
            else:
                self.files += 1
            real(fd)

        monkeypatch.setattr(os, "fsync", counting)


def test_claim_specs_are_written_and_removed_without_a_fsync(
    specs: CdiSpecs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal holds every prepared claim's spec and start-up rewrites a lost or
    partial one: a claim spec costs no fsync; the common spec stays durable."""
    specs.write_claim_spec("warm-up", ClaimSpec(()))  # creates the root
    spy = FsyncSpy(monkeypatch)
    for uid in ("a", "b", "c"):
        specs.write_claim_spec(uid, ClaimSpec((CdiDevice(f"{uid}-gpu-0", ()),)))
    for uid in ("a", "b", "never-written"):
        specs.remove_claim_spec(uid)
    assert set(specs.list_claim_specs()) == {"warm-up", "c"}
    assert (spy.files, spy.dirs) == (0, 0)
    specs.write_common_spec("node-a")
    assert (spy.files, spy.dirs) == (1, 1)


def test_claim_spec_is_compares_the_bytes_on_disk(specs: CdiSpecs) -> None:
    spec = ClaimSpec((CdiDevice("a-gpu-0", ("A=1",)),))
    assert not specs.claim_spec_is("a", spec)  # absent
    specs.write_claim_spec("a", spec)
    assert specs.claim_spec_is("a", spec)
    assert not specs.claim_spec_is("a", ClaimSpec((CdiDevice("a-gpu-0", ("A=2",)),)))
    path = specs.claim_spec_path("a")
    path.write_bytes(path.read_bytes()[:10])  # what a power loss may leave
    assert not specs.claim_spec_is("a", spec)


def test_claim_spec_round_trips_through_json() -> None:
    spec = ClaimSpec(
        (
            CdiDevice("u-gpu-0", ("A=1", "B=2"), (DeviceNode("/dev/nvidia0", 195, 0, 0o666),)),
            CdiDevice("u-gpu-1", ()),
        ),
    )
    assert ClaimSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"devices": {}}, "cdiSpec.devices"),
        ({"devices": [], "deviceNodes": [1]}, "cdiSpec.deviceNodes"),
        ({"devices": [{"name": "x", "containerEdits": {"env": [1]}}]}, "env"),
        ({"devices": [{"name": "x"}]}, "containerEdits"),
    ],
)
def test_claim_spec_from_json_names_the_bad_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ClaimSpec.from_json(doc)


@pytest.mark.parametrize("dangling", [False, True])
def test_symlink_at_a_claim_spec_path_is_never_followed(
    specs: CdiSpecs, tmp_path: Path, dangling: bool
) -> None:
    """A spec-like file elsewhere, linked in at a claim's path: reading it is refused
    (ELOOP), and it does not count as the claim's spec."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"cdiVersion": "0.3.0", "kind": "k8s.gpu.example.com/gpu"}')
    specs.root.mkdir()
    link = specs.claim_spec_path(UID)
    link.symlink_to(tmp_path / "gone.json" if dangling else elsewhere)
    with pytest.raises(UnsafeFileError) as info:
        specs.read_claim_spec(UID)
    assert info.value.errno == errno.ELOOP
    assert str(info.value) == (
        f"[Errno {errno.ELOOP}] is a symbolic link; refusing to follow it: '{link}'"
    )
    assert not specs.claim_spec_exists(UID)
    # Writing the claim's spec replaces the link, never the file it points to.
    specs.write_claim_spec(UID, ClaimSpec((CdiDevice(f"{UID}-gpu-0", ("A=1",)),)))
    assert not link.is_symlink() and specs.claim_spec_exists(UID)
    assert specs.read_claim_spec(UID) is not None
    assert elsewhere.read_text().startswith('{"cdiVersion": "0.3.0"')


@pytest.mark.parametrize("dangling", [False, True])
def test_symlink_named_like_a_claim_spec_is_not_listed(
    specs: CdiSpecs, tmp_path: Path, dangling: bool
) -> None:
    """Only regular files are this driver's claim specs: a link planted in the CDI root
    is not listed, so recovery never reports it as an orphan and unprepare never
    reads or removes through it; what it points to is left alone."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    specs.write_claim_spec("mine", ClaimSpec((CdiDevice("mine-gpu-0", ()),)))
    specs.claim_spec_path("planted").symlink_to(tmp_path / "gone" if dangling else elsewhere)
    (specs.root / "k8s.gpu.example.com-gpu_dir.json").mkdir()
    assert specs.list_claim_specs() == {"mine": specs.claim_spec_path("mine")}
    assert elsewhere.read_text() == "{}"


def test_non_regular_file_at_a_claim_spec_path_is_refused(specs: CdiSpecs) -> None:
    specs.root.mkdir()
    os.mkfifo(specs.claim_spec_path(UID))
    with pytest.raises(UnsafeFileError) as info:
        specs.read_claim_spec(UID)  # a plain open() would block
    assert info.value.errno == errno.EINVAL
    assert not specs.claim_spec_exists(UID)
