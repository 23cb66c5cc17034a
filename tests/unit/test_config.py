"""GpuConfig: strict decoding, defaults, static and device rules, config resolution."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from typing import Any

import pytest

from driver.config import (
    API_VERSION,
    KIND,
    ConfigError,
    FieldError,
    GpuConfig,
    Interval,
    Strategy,
    decode_gpu_config,
    default_gpu_config,
    gpu_config_errors,
    load_yaml_documents,
    loads_json,
    resolve_configs,
    validate_claim_document,
    validate_for_device,
)
from driver.config.gpu import MAX_PARTITION_COUNT, SpacePartitioningConfig
from driver.errors import DriverError, ErrorClass

P = "spec.devices.config[0].opaque.parameters"
DRIVER = "gpu.example.com"


def gpu(sharing: Any = None, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
    if sharing is not None:
        doc["sharing"] = sharing
    doc.update(extra)
    return doc


def errors_of(parameters: object, path: str = P) -> list[FieldError]:
    with pytest.raises(ConfigError) as info:
        decode_gpu_config(parameters, path)
    return info.value.errors


# --- strict decoding -------------------------------------------------------------------


def test_unknown_field_is_named_with_full_path() -> None:
    errs = errors_of(
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short", "x": 1}})
    )
    assert errs == [FieldError(f"{P}.sharing.timeSlicingConfig.x", "unknown field")]


def test_unknown_top_level_field() -> None:
    assert errors_of(gpu(metadata={"name": "x"})) == [FieldError(f"{P}.metadata", "unknown field")]


def test_field_names_are_case_sensitive() -> None:
    errs = errors_of(gpu({"Strategy": "TimeSlicing"}))
    assert FieldError(f"{P}.sharing.Strategy", "unknown field") in errs
    assert FieldError(f"{P}.sharing.strategy", "required field missing") in errs


def test_duplicate_key_in_json_text() -> None:
    raw = (
        f'{{"apiVersion": "{API_VERSION}", "kind": "GpuConfig", "sharing": {{"strategy": '
        '"SpacePartitioning", "spacePartitioningConfig":'
        ' {"partitionCount": 2, "partitionCount": 3}}}'
    )
    assert errors_of(raw) == [
        FieldError(f"{P}.sharing.spacePartitioningConfig.partitionCount", "duplicate field")
    ]


def test_duplicate_key_in_yaml_text_and_bytes() -> None:
    raw = f"apiVersion: {API_VERSION}\nkind: GpuConfig\nkind: GpuConfig\n"
    assert errors_of(raw) == [FieldError(f"{P}.kind", "duplicate field")]
    assert errors_of(raw.encode()) == [FieldError(f"{P}.kind", "duplicate field")]


def test_duplicate_key_survives_loads_json_of_whole_claim() -> None:
    claim = loads_json(
        '{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "spec": {"devices":'
        ' {"config": [{"opaque": {"driver": "gpu.example.com", "parameters": {"apiVersion":'
        f' "{API_VERSION}", "kind": "GpuConfig", "sharing": {{"strategy": "TimeSlicing",'
        ' "strategy": "TimeSlicing"}}}}]}}}'
    )
    assert validate_claim_document(claim, DRIVER) == [
        FieldError(f"{P}.sharing.strategy", "duplicate field")
    ]


def test_yaml_merge_keys_are_not_duplicates() -> None:
    (doc,) = load_yaml_documents(
        "base: &b {strategy: SpacePartitioning}\n"
        f"cfg: {{apiVersion: {API_VERSION}, kind: GpuConfig,\n"
        "  sharing: {<<: *b, strategy: TimeSlicing}}\n"
    )
    assert decode_gpu_config(doc["cfg"]).strategy is Strategy.TIME_SLICING


@pytest.mark.parametrize(
    ("sharing", "field", "message"),
    [
        (
            {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": "2"}},
            "sharing.spacePartitioningConfig.partitionCount",
            "must be an integer",
        ),
        (
            {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": True}},
            "sharing.spacePartitioningConfig.partitionCount",
            "must be an integer",
        ),
        (
            {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 2.0}},
            "sharing.spacePartitioningConfig.partitionCount",
            "must be an integer",
        ),
        ({"strategy": 1}, "sharing.strategy", "must be a string"),
        ({"strategy": None}, "sharing.strategy", "must be a string"),
        (
            {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 5}},
            "sharing.timeSlicingConfig.interval",
            "must be a string",
        ),
        (
            {"strategy": "TimeSlicing", "timeSlicingConfig": "Short"},
            "sharing.timeSlicingConfig",
            "must be an object",
        ),
        ("TimeSlicing", "sharing", "must be an object"),
        ({}, "sharing.strategy", "required field missing"),
    ],
)
def test_wrong_types_are_not_coerced(sharing: Any, field: str, message: str) -> None:
    assert errors_of(gpu(sharing)) == [FieldError(f"{P}.{field}", message)]


def test_api_version_and_kind_are_required_and_checked() -> None:
    errs = errors_of({})
    assert FieldError(f"{P}.apiVersion", "required field missing") in errs
    assert FieldError(f"{P}.kind", "required field missing") in errs
    errs = errors_of({"apiVersion": "gpu.resource.example.com/v1", "kind": "NetConfig"})
    assert [e.path for e in errs] == [f"{P}.apiVersion", f"{P}.kind"]
    assert "expected 'gpu.resource.example.com/v1alpha1'" in errs[0].message


@pytest.mark.parametrize("value", [None, [], "x", 3, ["a"]])
def test_parameters_must_be_an_object(value: object) -> None:
    # a str is parsed as YAML: "x" is a scalar, not an object
    assert errors_of(value) == [FieldError(P, "must be an object")]


def test_invalid_text() -> None:
    (err,) = errors_of("{not json")
    assert err.path == P and err.message.startswith("invalid JSON")
    (err,) = errors_of(b"\xff\xfe")
    assert "UTF-8" in err.message


def test_config_error_is_permanent_invalid_config() -> None:
    with pytest.raises(DriverError) as info:
        decode_gpu_config(gpu({"strategy": "Foo"}), P)
    assert info.value.error_class is ErrorClass.INVALID_CONFIG
    assert str(info.value).startswith(f"permanent (invalid-config): {P}.sharing.strategy: ")


# --- defaults ------------------------------------------------------------------------


def test_default_config() -> None:
    cfg = default_gpu_config()
    assert cfg.to_dict() == {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}},
    }
    assert cfg.strategy is Strategy.TIME_SLICING
    assert cfg.interval is Interval.DEFAULT
    assert cfg.partition_count is None


def test_no_sharing_defaults_to_time_slicing_default() -> None:
    assert decode_gpu_config(gpu()) == default_gpu_config()
    assert decode_gpu_config(gpu(sharing=None)) == default_gpu_config()
    assert decode_gpu_config({**gpu(), "sharing": None}) == default_gpu_config()


def test_time_slicing_without_config_gets_default_interval() -> None:
    assert decode_gpu_config(gpu({"strategy": "TimeSlicing"})) == default_gpu_config()
    cfg = decode_gpu_config(gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {}}))
    assert cfg == default_gpu_config()


def test_space_partitioning_without_config_gets_one_partition() -> None:
    for sharing in (
        {"strategy": "SpacePartitioning"},
        {"strategy": "SpacePartitioning", "spacePartitioningConfig": {}},
    ):
        cfg = decode_gpu_config(gpu(sharing))
        assert cfg.strategy is Strategy.SPACE_PARTITIONING
        assert cfg.partition_count == 1
        assert cfg.interval is None
        assert cfg.to_dict()["sharing"] == {
            "strategy": "SpacePartitioning",
            "spacePartitioningConfig": {"partitionCount": 1},
        }


def test_explicit_values_kept() -> None:
    cfg = decode_gpu_config(
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    )
    assert cfg.interval is Interval.LONG
    cfg = decode_gpu_config(
        gpu({"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 7}})
    )
    assert cfg.partition_count == 7


def test_decoded_configs_are_hashable_values() -> None:
    a = decode_gpu_config(gpu({"strategy": "TimeSlicing"}))
    assert {a: 1}[default_gpu_config()] == 1


# --- static rules ----------------------------------------------------------------------


def test_unknown_strategy() -> None:
    (err,) = errors_of(gpu({"strategy": "Magic"}))
    assert err.path == f"{P}.sharing.strategy"
    assert err.message.startswith("unknown GPU sharing strategy: 'Magic'")


def test_unknown_interval() -> None:
    (err,) = errors_of(gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Fast"}}))
    assert err.path == f"{P}.sharing.timeSlicingConfig.interval"
    assert err.message.startswith("unknown time-slice interval: 'Fast'")


@pytest.mark.parametrize("count", [0, -1])
def test_partition_count_must_be_positive(count: int) -> None:
    sharing = {
        "strategy": "SpacePartitioning",
        "spacePartitioningConfig": {"partitionCount": count},
    }
    assert errors_of(gpu(sharing)) == [
        FieldError(
            f"{P}.sharing.spacePartitioningConfig.partitionCount", f"must be >= 1, got {count}"
        )
    ]


@pytest.mark.parametrize(
    ("count", "shown"),
    [(MAX_PARTITION_COUNT + 1, str(MAX_PARTITION_COUNT + 1)), (10**30, "a number of 100 bits")],
)
def test_partition_count_is_bounded(count: int, shown: str) -> None:
    sharing = {
        "strategy": "SpacePartitioning",
        "spacePartitioningConfig": {"partitionCount": count},
    }
    expected = [
        FieldError(
            f"{P}.sharing.spacePartitioningConfig.partitionCount",
            f"must be <= {MAX_PARTITION_COUNT}, got {shown}",
        )
    ]
    assert errors_of(gpu(sharing)) == expected
    # The same from the wire: JSON and YAML text, as the webhook and the CLI read it.
    assert errors_of(loads_json(json.dumps(gpu(sharing)))) == expected


def test_partition_count_up_to_the_bound_is_accepted() -> None:
    sharing = {
        "strategy": "SpacePartitioning",
        "spacePartitioningConfig": {"partitionCount": MAX_PARTITION_COUNT},
    }
    assert decode_gpu_config(gpu(sharing)).partition_count == MAX_PARTITION_COUNT == 64


def test_integers_too_long_to_convert_are_errors_not_crashes() -> None:
    digits = "1" * 5000  # past Python's int/str conversion limit
    for text in (
        f'{{"partitionCount": {digits}}}',
        f"apiVersion: {API_VERSION}\nkind: {KIND}\nsharing:\n  strategy: SpacePartitioning\n"
        f"  spacePartitioningConfig:\n    partitionCount: {digits}\n",
    ):
        config, errors = gpu_config_errors(text, P)
        assert config is None and len(errors) == 1 and errors[0].path == P, errors
        assert "invalid" in errors[0].message


def test_sub_config_must_match_strategy() -> None:
    assert errors_of(
        gpu({"strategy": "TimeSlicing", "spacePartitioningConfig": {"partitionCount": 2}})
    ) == [
        FieldError(f"{P}.sharing.spacePartitioningConfig", "not allowed with strategy TimeSlicing")
    ]
    assert errors_of(
        gpu({"strategy": "SpacePartitioning", "timeSlicingConfig": {"interval": "Short"}})
    ) == [
        FieldError(f"{P}.sharing.timeSlicingConfig", "not allowed with strategy SpacePartitioning")
    ]


def test_never_both_sub_configs() -> None:
    sharing = {
        "strategy": "TimeSlicing",
        "timeSlicingConfig": {"interval": "Short"},
        "spacePartitioningConfig": {"partitionCount": 2},
    }
    assert errors_of(gpu(sharing)) == [
        FieldError(
            f"{P}.sharing", "timeSlicingConfig and spacePartitioningConfig are mutually exclusive"
        )
    ]


def test_all_static_errors_reported_at_once() -> None:
    sharing = {"strategy": "X", "timeSlicingConfig": {"interval": "Y"}}
    paths = [e.path for e in errors_of(gpu(sharing), "")]
    assert paths == ["sharing.strategy", "sharing.timeSlicingConfig.interval"]


# --- device rules ----------------------------------------------------------------------


def sp(count: int) -> GpuConfig:
    return decode_gpu_config(
        gpu({"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": count}})
    )


def test_partition_count_within_device_limit() -> None:
    validate_for_device(sp(7), device_name="gpu-0", is_partition=False, max_partitions=7)
    validate_for_device(
        sp(MAX_PARTITION_COUNT), device_name="gpu-0", is_partition=False, max_partitions=None
    )
    validate_for_device(
        default_gpu_config(), device_name="gpu-0-mig-1g10gb-0", is_partition=True, max_partitions=0
    )


def test_impossible_partition_count() -> None:
    with pytest.raises(ConfigError) as info:
        validate_for_device(
            sp(8),
            device_name="gpu-3",
            is_partition=False,
            max_partitions=7,
            path="status.allocation.devices.config[2].opaque.parameters",
        )
    err = info.value
    assert err.error_class is ErrorClass.INVALID_CONFIG and err.permanent
    (field,) = err.errors
    assert field.path == (
        "status.allocation.devices.config[2].opaque.parameters"
        ".sharing.spacePartitioningConfig.partitionCount"
    )
    assert "impossible partition count" in field.message
    assert "gpu-3" in field.message and "7" in field.message and "8" in field.message


def test_partition_count_built_in_code_is_bounded_on_devices_without_a_limit() -> None:
    config = decode_gpu_config(gpu({"strategy": "SpacePartitioning"}))
    assert config.sharing is not None
    huge = dataclasses.replace(
        config,
        sharing=dataclasses.replace(
            config.sharing, spacePartitioningConfig=SpacePartitioningConfig(partitionCount=10**30)
        ),
    )
    with pytest.raises(ConfigError) as info:
        validate_for_device(huge, device_name="gpu-0", is_partition=False, max_partitions=None)
    assert f"supports at most {MAX_PARTITION_COUNT} partitions" in str(info.value)
    assert "a number of 100 bits" in str(info.value)


def test_no_space_partitioning_on_a_partition() -> None:
    with pytest.raises(ConfigError) as info:
        validate_for_device(
            sp(1), device_name="gpu-0-mig-1g10gb-0", is_partition=True, max_partitions=None
        )
    message = str(info.value)
    assert message.startswith("permanent (invalid-config): sharing.spacePartitioningConfig")
    assert "gpu-0-mig-1g10gb-0" in message and "itself a partition" in message


# --- resolution -----------------------------------------------------------------------


def opaque(
    sharing: Any,
    *,
    source: str = "FromClaim",
    requests: list[str] | None = None,
    driver: str = DRIVER,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "source": source,
        "opaque": {"driver": driver, "parameters": gpu(sharing)},
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def result(request: str, device: str = "gpu-0", driver: str = DRIVER) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": "node-a", "device": device}


def alloc(results: list[dict[str, Any]], config: list[dict[str, Any]]) -> dict[str, Any]:
    return {"devices": {"results": results, "config": config}}


TS_SHORT = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}
TS_LONG = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
SP_2 = {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 2}}


def test_results_without_config_get_default() -> None:
    out = resolve_configs(alloc([result("a"), result("b", "gpu-1")], []), DRIVER)
    assert out == {"a": default_gpu_config(), "b": default_gpu_config()}
    assert resolve_configs({}, DRIVER) == {}


def test_claim_beats_class_regardless_of_list_order() -> None:
    out = resolve_configs(
        alloc(
            [result("a")],
            [
                opaque(TS_SHORT, source="FromClaim"),
                opaque(TS_LONG, source="FromClass", requests=["a"]),
            ],
        ),
        DRIVER,
    )
    assert out["a"].interval is Interval.SHORT


def test_later_wins_within_a_source_and_whole_object() -> None:
    out = resolve_configs(alloc([result("a")], [opaque(SP_2), opaque(TS_LONG)]), DRIVER)
    assert out["a"].interval is Interval.LONG and out["a"].partition_count is None


def test_requests_select_results_and_empty_means_all() -> None:
    cfgs = [opaque(TS_LONG), opaque(SP_2, requests=["b"])]
    out = resolve_configs(
        alloc([result("a"), result("b", "gpu-1"), result("c", "gpu-2")], cfgs), DRIVER
    )
    assert out["a"].interval is Interval.LONG
    assert out["b"].partition_count == 2
    assert out["c"].interval is Interval.LONG


def test_main_request_config_applies_to_sub_requests() -> None:
    results = [result("gpu/big"), result("gpux", "gpu-1"), result("other/small", "gpu-2")]
    out = resolve_configs(
        alloc(
            results,
            [
                opaque(SP_2, source="FromClass", requests=["gpu"]),
                opaque(TS_SHORT, requests=["other/small"]),
            ],
        ),
        DRIVER,
    )
    assert out["gpu/big"].partition_count == 2
    assert out["gpux"] == default_gpu_config()  # a prefix is not a sub-request
    assert out["other/small"].interval is Interval.SHORT


def test_sub_request_config_beats_main_request_config_when_later() -> None:
    results = [result("gpu/big"), result("gpu/small", "gpu-1")]
    out = resolve_configs(
        alloc(results, [opaque(SP_2, requests=["gpu"]), opaque(TS_SHORT, requests=["gpu/small"])]),
        DRIVER,
    )
    assert out["gpu/big"].partition_count == 2
    assert out["gpu/small"].interval is Interval.SHORT


def test_other_drivers_ignored() -> None:
    results = [result("a"), result("n", "eth0", driver="net.example.com")]
    cfgs = [
        opaque(TS_SHORT),
        {
            "source": "FromClaim",
            "opaque": {"driver": "net.example.com", "parameters": {"whatever": True}},
        },
        {"source": "FromSomewhere", "opaque": {"driver": "net.example.com", "parameters": {}}},
    ]
    out = resolve_configs(alloc(results, cfgs), DRIVER)
    assert out == {"a": decode_gpu_config(gpu(TS_SHORT))}


def test_non_opaque_config_and_bad_source_are_errors() -> None:
    cfgs = [{"source": "FromClaim", "requests": ["a"]}, opaque(TS_SHORT, source="Nowhere")]
    with pytest.raises(ConfigError) as info:
        resolve_configs(alloc([result("a")], cfgs), DRIVER)
    assert info.value.errors == [
        FieldError(
            "status.allocation.devices.config[0]",
            "only opaque parameters are supported by this driver",
        ),
        FieldError(
            "status.allocation.devices.config[1].source", "invalid config source: 'Nowhere'"
        ),
    ]


def test_invalid_config_of_this_driver_fails_with_its_path() -> None:
    cfgs = [
        opaque(TS_SHORT, source="FromClass"),
        opaque(
            {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 0}},
            requests=["zzz"],
        ),
    ]
    with pytest.raises(ConfigError) as info:
        resolve_configs(alloc([result("a")], cfgs), DRIVER, path_prefix="cfg")
    assert info.value.errors == [
        FieldError(
            "cfg[1].opaque.parameters.sharing.spacePartitioningConfig.partitionCount",
            "must be >= 1, got 0",
        )
    ]


def test_duplicate_key_in_allocation_read_as_json() -> None:
    text = json.dumps(alloc([result("a")], [opaque(TS_SHORT)]))
    text = text.replace(
        '"strategy": "TimeSlicing"', '"strategy": "TimeSlicing", "strategy": "TimeSlicing"'
    )
    with pytest.raises(ConfigError) as info:
        resolve_configs(loads_json(text), DRIVER)
    assert [e.message for e in info.value.errors] == ["duplicate field"]
    assert info.value.errors[0].path.endswith("config[0].opaque.parameters.sharing.strategy")


# --- documents -----------------------------------------------------------------------


def claim(configs: list[Any], version: str = "v1") -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {"devices": {"config": configs}},
    }


def test_validate_claim_document_kinds() -> None:
    bad = {"opaque": {"driver": DRIVER, "parameters": gpu({"strategy": "X"})}}
    good = {"requests": ["a"], "opaque": {"driver": DRIVER, "parameters": gpu(SP_2)}}
    other = {"opaque": {"driver": "other.example.com", "parameters": {"x": 1}}}
    assert validate_claim_document(claim([good, other]), DRIVER) == []
    (err,) = validate_claim_document(claim([good, bad], "v1beta1"), DRIVER)
    assert err.path == "spec.devices.config[1].opaque.parameters.sharing.strategy"
    template = {
        "apiVersion": "resource.k8s.io/v1beta2",
        "kind": "ResourceClaimTemplate",
        "spec": {"spec": {"devices": {"config": [bad]}}},
    }
    (err,) = validate_claim_document(template, DRIVER)
    assert err.path == "spec.spec.devices.config[0].opaque.parameters.sharing.strategy"
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "spec": {"config": [bad]},
    }
    (err,) = validate_claim_document(device_class, DRIVER)
    assert err.path == "spec.config[0].opaque.parameters.sharing.strategy"
    (err,) = validate_claim_document(gpu({"strategy": "X"}), DRIVER)
    assert err.path == "sharing.strategy"
    assert validate_claim_document({"apiVersion": "v1", "kind": "Pod"}, DRIVER) == []
    missing = {"opaque": {"driver": DRIVER}}
    assert validate_claim_document(claim([missing]), DRIVER) == [
        FieldError("spec.devices.config[0].opaque.parameters", "required field missing")
    ]
    assert validate_claim_document({**claim([]), "spec": "x"}, DRIVER) == [
        FieldError("spec", "must be an object")
    ]


# --- fuzz-ish ------------------------------------------------------------------------

_WORDS = [
    "apiVersion",
    "kind",
    "sharing",
    "strategy",
    "timeSlicingConfig",
    "interval",
    "spacePartitioningConfig",
    "partitionCount",
    API_VERSION,
    KIND,
    "TimeSlicing",
    "SpacePartitioning",
    "Default",
    "Long",
    "",
    "x",
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(9 if depth < 4 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice([0, 1, -1, 7, 2**70, -(2**70)])
    if choice == 3:
        return rng.choice([0.5, 1.0, -3.25])
    if choice in (4, 5):
        return rng.choice(_WORDS)
    if choice == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(_WORDS): _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _mutated_valid(rng: random.Random) -> Any:
    doc: dict[str, Any] = gpu(rng.choice([TS_SHORT, TS_LONG, SP_2, {"strategy": "TimeSlicing"}]))
    doc = json.loads(json.dumps(doc))
    target: Any = doc
    while isinstance(target, dict) and target and rng.random() < 0.7:
        key = rng.choice(list(target))
        if rng.random() < 0.5 or not isinstance(target[key], dict):
            target[key] = _random_value(rng)
            break
        target = target[key]
    return doc


def test_random_values_never_crash() -> None:
    rng = random.Random(5322)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):
        value = _mutated_valid(rng) if rng.random() < 0.6 else _random_value(rng)
        if rng.random() < 0.2:
            value = json.dumps(value)
        try:
            cfg = decode_gpu_config(value, "p")
        except ConfigError as err:
            assert err.errors and all(e.path.startswith("p") for e in err.errors)
            outcomes["error"] += 1
        else:
            assert cfg.strategy in (Strategy.TIME_SLICING, Strategy.SPACE_PARTITIONING)
            assert decode_gpu_config(cfg.to_dict()) == cfg  # defaults are idempotent
            outcomes["ok"] += 1
        # the same value inside a claim and an allocation: a list of errors or a result
        validate_claim_document(
            claim([{"opaque": {"driver": DRIVER, "parameters": value}}]), DRIVER
        )
        with contextlib.suppress(ConfigError):
            resolve_configs(
                alloc(
                    [result("a")],
                    [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": value}}],
                ),
                DRIVER,
            )
    assert outcomes["ok"] > 100 and outcomes["error"] > 100


def test_random_text_never_crashes() -> None:
    rng = random.Random(1)
    alphabet = "{}[]:,\"'- \n\tab01&*!|>%@`\\"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        with contextlib.suppress(ConfigError):
            decode_gpu_config(text, "p")
    deep = "[" * 100000 + "]" * 100000
    assert errors_of(deep, "p") == [FieldError("p", "invalid JSON: too deeply nested")]
    deep_yaml = "a:\n" + "- " * 5000 + "x\n"
    assert errors_of(deep_yaml, "p") == [FieldError("p", "invalid YAML: too deeply nested")]


def test_random_structures_for_resolve_never_crash() -> None:
    rng = random.Random(7)
    for _ in range(1000):
        allocation = _random_value(rng)
        if rng.random() < 0.5:
            allocation = {"devices": {"results": _random_value(rng), "config": _random_value(rng)}}
        with contextlib.suppress(ConfigError):
            resolve_configs(allocation, DRIVER)


def test_space_partitioning_is_refused_on_a_share_time_slicing_allowed() -> None:
    """A share of a multi-allocatable GPU (docs/sharing.md) is a slice of a time-sliced
    GPU: SpacePartitioning is invalid-config on it; TimeSlicing and defaults are fine."""
    with pytest.raises(DriverError) as exc:
        validate_for_device(
            sp(2), device_name="gpu-0", is_partition=False, max_partitions=7, share=True
        )
    assert exc.value.error_class is ErrorClass.INVALID_CONFIG
    assert "share" in str(exc.value) and "gpu-0" in str(exc.value)
    ts = decode_gpu_config(gpu({"strategy": "TimeSlicing"}))
    validate_for_device(ts, device_name="gpu-0", is_partition=False, max_partitions=7, share=True)
    validate_for_device(
        default_gpu_config(), device_name="gpu-0", is_partition=False, max_partitions=7, share=True
    )
