"""Mock fleets and the built-in model profiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from driver.nvml.mock import fleet as fl

MIG_MODELS = ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB")
DIMENSIONS = (
    "memoryMiB",
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
)


def test_builtin_models_present() -> None:
    models = fl.model_profiles()
    assert set(models) == {*MIG_MODELS, "example"}
    for name in MIG_MODELS:
        assert models[name].mig_capable
    assert not models["example"].mig_capable
    assert models["example"].referenceExample


@pytest.mark.parametrize("model", MIG_MODELS)
def test_mig_tables_use_the_real_profile_ids_and_placements(model: str) -> None:
    mig = fl.model_profiles()[model].mig
    assert mig is not None
    by_id = {p.id: p for p in mig.profiles}
    assert set(by_id) == {0, 5, 9, 14, 15, 19, 20}
    expected_placements = {
        19: [(s, 1) for s in range(7)],
        20: [(s, 1) for s in range(7)],
        15: [(0, 2), (2, 2), (4, 2), (6, 2)],
        14: [(0, 2), (2, 2), (4, 2)],
        9: [(0, 4), (4, 4)],
        5: [(0, 4)],
        0: [(0, 8)],
    }
    for pid, placements in expected_placements.items():
        assert list(by_id[pid].placements) == placements, (model, pid)
    assert by_id[20].name.endswith("+me") and by_id[20].ofaEngines == 1
    assert [by_id[i].instanceCount for i in (19, 20, 15, 14, 9, 5, 0)] == [7, 1, 4, 3, 2, 1, 1]
    for p in mig.profiles:
        assert re.fullmatch(r"\dg\.\d+gb(\+me)?", p.name)
        assert p.name.startswith(f"{p.sliceCount}g.")


def test_spot_check_published_values() -> None:
    models = fl.model_profiles()

    def prof(model: str, name: str) -> fl.MigProfileSpec:
        mig = models[model].mig
        assert mig is not None
        return next(p for p in mig.profiles if p.name == name)

    # `nvidia-smi mig -lgip`: 9.75 GiB, 16 SMs on H100; 39.25 GiB, 98 SMs on A100-40GB.
    h = prof("H100-80GB", "1g.10gb")
    assert (h.memoryMiB, h.multiprocessors, h.decoders, h.jpegEngines) == (9984, 16, 1, 1)
    a = prof("A100-40GB", "7g.40gb")
    assert (a.memoryMiB, a.multiprocessors, a.copyEngines, a.decoders) == (40192, 98, 7, 5)
    assert prof("A100-80GB", "1g.10gb").memoryMiB == 9728
    assert prof("H200-141GB", "7g.141gb").memoryMiB == 143360
    assert prof("H100-80GB", "7g.80gb").copyEngines == 8


@pytest.mark.parametrize("model", MIG_MODELS)
def test_max_instances_of_each_profile_fit_the_full_gpu(model: str) -> None:
    """Per-dimension capacity = the largest profile; N instances of a profile must fit it."""
    mig = fl.model_profiles()[model].mig
    assert mig is not None
    full = {d: max(getattr(p, d) for p in mig.profiles) for d in DIMENSIONS}
    for p in mig.profiles:
        # Choose instanceCount non-overlapping placements greedily.
        used: set[int] = set()
        chosen = 0
        for start, size in p.placements:
            slices = set(range(start, start + size))
            if not slices & used and chosen < p.instanceCount:
                used |= slices
                chosen += 1
        assert chosen == p.instanceCount, (model, p.name)
        for d in DIMENSIONS:
            assert getattr(p, d) * p.instanceCount <= full[d], (model, p.name, d)
        assert all(s >= 0 and s + n <= 8 for s, n in p.placements)


def test_default_fleet_is_eight_h100_with_mig() -> None:
    fleet = fl.default_fleet()
    gpus = fl.expand_fleet(fleet, "node-a")
    assert len(gpus) == 8
    assert {g.model for g in gpus} == {"H100-80GB"}
    assert all(g.mig_enabled for g in gpus)
    assert fleet.resolved_driver_version == "580.95.05"
    assert fleet.resolved_cuda_driver_version == "13.0"


PINNED_NODE_A_0 = "GPU-4f021113-d9d9-4e5c-bcb4-6d2f9864ef5b"
PINNED_WORKER_1 = "gpu-8a7f3103-0969-4b90-a091-2327dbcf1e5e"
UUID_TAIL = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def test_example_fleet_has_reference_shaped_uuids_stable_per_node() -> None:
    """`example` GPUs have the reference's UUID shape (`gpu-` + lowercase 8-4-4-4-12),
    the same for a node at every start, and no two nodes share one."""
    worker = "dra-example-driver-cluster-worker"
    gpus = fl.expand_fleet(fl.example_fleet(), worker)
    uuids = [g.uuid for g in gpus]
    assert uuids == [g.uuid for g in fl.expand_fleet(fl.example_fleet(), worker)]
    assert all(re.fullmatch(f"gpu-{UUID_TAIL}", u) for u in uuids)
    assert len(set(uuids)) == 8
    others = {
        g.uuid
        for n in ("test-node", "node-1", "node-2")
        for g in fl.expand_fleet(fl.example_fleet(), n)
    }
    assert not others & set(uuids) and len(others) == 24
    assert fl.example_fleet().resolved_driver_version == "1.0.0"
    assert not any(g.mig_enabled for g in gpus)


def test_mock_uuids_are_pinned() -> None:
    """The derivation is part of what a mock node publishes (and its health store and
    MIG state keep): a change to it must be deliberate."""
    assert fl.mock_gpu_uuid("node-a", 0) == PINNED_NODE_A_0
    assert fl.mock_gpu_uuid("node-a", 0, prefix="gpu") == "gpu-" + PINNED_NODE_A_0[4:]
    assert fl.mock_gpu_uuid("dra-example-driver-cluster-worker", 1, prefix="gpu") == PINNED_WORKER_1


def test_uuids_unique_across_many_nodes_and_indices() -> None:
    uuids = {fl.mock_gpu_uuid(f"node-{n}", i) for n in range(200) for i in range(16)}
    assert len(uuids) == 200 * 16


def test_uuids_deterministic_per_node() -> None:
    fleet = fl.parse_fleet({"gpus": [{"model": "A100-80GB", "count": 4}]})
    a1 = [g.uuid for g in fl.expand_fleet(fleet, "node-a")]
    a2 = [g.uuid for g in fl.expand_fleet(fleet, "node-a")]
    b = [g.uuid for g in fl.expand_fleet(fleet, "node-b")]
    assert a1 == a2
    assert not set(a1) & set(b)
    assert len(set(a1)) == 4
    for u in a1:
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", u)


def test_mixed_fleet_indices_pci_and_mig_mode() -> None:
    fleet = fl.parse_fleet(
        {
            "gpus": [
                {"model": "H100-80GB", "count": 2, "migMode": "disabled"},
                {"model": "A100-40GB", "count": 1},
                {"model": "example", "count": 9},
            ],
            "driverVersion": "550.54.15",
            "cudaDriverVersion": "12.4",
        }
    )
    gpus = fl.expand_fleet(fleet, "n")
    assert [g.index for g in gpus] == list(range(12))
    assert [g.mig_enabled for g in gpus[:3]] == [False, False, True]
    assert gpus[3].uuid == fl.mock_gpu_uuid("n", 3, prefix="gpu")
    assert gpus[2].uuid == fl.mock_gpu_uuid("n", 2)
    assert len({g.uuid.lower() for g in gpus}) == 12
    assert len({g.pci_bus_id for g in gpus}) == 12
    assert gpus[0].pci_bus_id == "00000000:18:00.0"
    assert gpus[8].pci_bus_id.startswith("00000001:")
    assert fleet.resolved_driver_version == "550.54.15"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpus": [{"model": "H100-80GB", "cout": 2}]}, "gpus[0].cout: unknown field"),
        ({"gpus": [{"model": "H100-80GB"}], "extra": 1}, "extra: unknown field"),
        ({"gpus": [{"model": "B300"}]}, "gpus[0].model: unknown model 'B300'"),
        ({"gpus": [{"model": "H100-80GB", "count": "8"}]}, "gpus[0].count: Expected `int`"),
        ({"gpus": [{"model": "H100-80GB", "count": 0}]}, "gpus[0].count"),
        ({"gpus": [{"model": "H100-80GB", "migMode": "on"}]}, "gpus[0].migMode"),
        ({"gpus": [{"model": "example", "migMode": "enabled"}]}, "not MIG-capable"),
        ({"gpus": []}, "gpus: at least one GPU group"),
        ({}, "gpus: missing required field"),
        ({"gpus": [{"model": "H100-80GB"}], "cudaDriverVersion": "13"}, "cudaDriverVersion"),
        (
            {"gpus": [{"model": "H100-80GB", "count": 1000}, {"model": "A100-40GB", "count": 100}]},
            "exceed the maximum",
        ),
    ],
)
def test_strict_errors_name_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(fl.FleetError) as err:
        fl.parse_fleet(data)
    assert message in str(err.value)


def test_non_mapping_is_an_error() -> None:
    with pytest.raises(fl.FleetError, match="expected a mapping"):
        fl.parse_fleet(["gpus"])


def test_load_fleet_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("gpus:\n- model: H200-141GB\n  count: 2\ndriverVersion: '570.1.2'\n")
    fleet = fl.load_fleet(path)
    assert fleet.gpus[0].model == "H200-141GB" and fleet.gpus[0].count == 2
    assert fl.resolve_fleet(path) == fleet


def test_load_fleet_errors(tmp_path: Path) -> None:
    with pytest.raises(fl.FleetError, match="cannot read"):
        fl.load_fleet(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [\n")
    with pytest.raises(fl.FleetError, match="invalid YAML"):
        fl.load_fleet(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("gpus:\n- modle: H100-80GB\n")
    with pytest.raises(fl.FleetError, match=r"typo.yaml: .*gpus\[0\]\.modle: unknown field"):
        fl.load_fleet(typo)


def test_resolve_builtin_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert fl.resolve_fleet(None) == fl.default_fleet()
    assert fl.resolve_fleet("default") == fl.default_fleet()
    assert fl.resolve_fleet("example") == fl.example_fleet()
    # An existing file wins over a built-in name.
    (tmp_path / "example").write_text("gpus:\n- model: A100-40GB\n")
    assert fl.resolve_fleet("example").gpus[0].model == "A100-40GB"


def test_mig_instances_apply_to_every_gpu_of_the_group() -> None:
    instances = [{"profile": "4g.20gb", "start": 0}, {"profile": "3g.20gb", "start": 4}]
    fleet = fl.parse_fleet(
        {
            "gpus": [
                {"model": "A100-40GB", "count": 2, "migInstances": instances},
                {"model": "H100-80GB"},
            ]
        }
    )
    gpus = fl.expand_fleet(fleet, "n")
    placed = [[(p.profile.name, p.profile.id, p.start, p.size) for p in g.static_mig] for g in gpus]
    assert placed == [[("4g.20gb", 5, 0, 4), ("3g.20gb", 9, 4, 4)]] * 2 + [[]]
    assert fl.default_fleet().gpus[0].migInstances == ()


def test_mig_conflict_rules() -> None:
    mig = fl.model_profiles()["H100-80GB"].mig
    assert mig is not None and mig.compute_slices == 7

    def at(name: str, start: int) -> fl.MigPlacement:
        profile = mig.by_name(name)
        assert profile is not None
        return fl.MigPlacement(profile, start, dict(profile.placements)[start])

    four = [at("4g.40gb", 0)]
    assert fl.mig_conflict(mig, four, at("3g.40gb", 4)) is None
    assert fl.mig_conflict(mig, four, at("1g.10gb", 3)) == "1g.10gb at 3 overlaps 4g.40gb at 0"
    me = [at("1g.10gb+me", 6)]
    assert "at most 1" in str(fl.mig_conflict(mig, me, at("1g.10gb+me", 0)))
    sevens = [at("1g.10gb", s) for s in range(6)] + [at("1g.20gb", 6)]
    assert fl.mig_conflict(mig, sevens[:6], sevens[6]) is None
    assert mig.by_id(15) == sevens[6].profile and mig.by_id(99) is None
