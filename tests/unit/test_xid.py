"""XidPolicy: default application Xids, additive ignore list, forced-fatal list."""

from __future__ import annotations

import pytest

from driver.health.xid import (
    DEFAULT_IGNORED_XIDS,
    Verdict,
    XidListError,
    XidPolicy,
    attributed_instance,
    parse_taint_effect,
    parse_xid_list,
)
from driver.nvml.discovered import HealthEvent

UUID = "GPU-00000000-0000-4000-8000-000000000000"


def xid(n: int) -> HealthEvent:
    return HealthEvent(UUID, "xid", xid=n)


def test_default_application_xids_are_ignored() -> None:
    policy = XidPolicy()
    assert {13, 31, 43, 45, 68, 109} == DEFAULT_IGNORED_XIDS
    for n in sorted(DEFAULT_IGNORED_XIDS):
        assert policy.classify(xid(n)) is Verdict.IGNORED
    for n in (48, 63, 64, 74, 79, 94, 95, 119):
        assert policy.classify(xid(n)) is Verdict.FATAL


def test_ecc_and_gpu_lost_are_always_fatal() -> None:
    policy = XidPolicy.from_flags("all", None)
    assert policy.classify(HealthEvent(UUID, "ecc-dbe")) is Verdict.FATAL
    assert policy.classify(HealthEvent(UUID, "gpu-lost")) is Verdict.FATAL
    assert policy.classify(HealthEvent(UUID, "xid", xid=None)) is Verdict.FATAL


def test_recovered_is_not_a_failure() -> None:
    assert XidPolicy().classify(HealthEvent(UUID, "recovered")) is Verdict.IGNORED


def test_additional_ignored_xids_add_to_defaults() -> None:
    policy = XidPolicy.from_flags("79, 94", None)
    assert policy.classify(xid(79)) is Verdict.IGNORED
    assert policy.classify(xid(94)) is Verdict.IGNORED
    assert policy.classify(xid(13)) is Verdict.IGNORED  # defaults kept
    assert policy.classify(xid(48)) is Verdict.FATAL


def test_fatal_xids_override_ignore_lists() -> None:
    policy = XidPolicy.from_flags("79", "79,13")
    assert policy.classify(xid(79)) is Verdict.FATAL
    assert policy.classify(xid(13)) is Verdict.FATAL
    assert policy.classify(xid(31)) is Verdict.IGNORED


def test_all_ignored_except_fatal() -> None:
    policy = XidPolicy.from_flags("all", "79")
    assert policy.classify(xid(79)) is Verdict.FATAL
    assert policy.classify(xid(48)) is Verdict.IGNORED
    assert XidPolicy.from_flags(None, "all").classify(xid(13)) is Verdict.FATAL


def test_int_iterables_accepted() -> None:
    policy = XidPolicy.from_flags([79], [13])
    assert policy.classify(xid(79)) is Verdict.IGNORED
    assert policy.classify(xid(13)) is Verdict.FATAL


def test_parse_empty_and_whitespace() -> None:
    assert parse_xid_list("", "--x").xids == frozenset()
    assert parse_xid_list(None, "--x").xids == frozenset()
    assert parse_xid_list(" 1 ,2", "--x").xids == frozenset({1, 2})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("79,abc", "'abc' is not an Xid"),
        ("79,,80", "item 2 is empty"),
        ("0", "out of range"),
        ("-5", "out of range"),
        ("4294967296", "out of range"),
        ("7.9", "'7.9' is not an Xid"),
    ],
)
def test_parse_errors_name_the_flag(text: str, fragment: str) -> None:
    with pytest.raises(XidListError) as err:
        XidPolicy.from_flags(text, None)
    assert str(err.value).startswith("--additional-xids-to-ignore: ")
    assert fragment in str(err.value)
    with pytest.raises(XidListError, match=r"^--fatal-xids: "):
        XidPolicy.from_flags(None, text)


def test_taint_effect_parsing() -> None:
    assert parse_taint_effect(None) == "NoSchedule"
    assert parse_taint_effect("noexecute") == "NoExecute"
    assert parse_taint_effect("None") == "None"
    with pytest.raises(XidListError, match=r"^--xid-taint-effect: 'Evict' is not one of"):
        parse_taint_effect("Evict")


def test_attribution_decides_scope_not_verdict() -> None:
    policy = XidPolicy()
    on_instance = HealthEvent(UUID, "xid", xid=94, gpu_instance_id=9, compute_instance_id=0)
    assert attributed_instance(on_instance) == 9
    assert policy.classify(on_instance) is Verdict.FATAL
    app_error = HealthEvent(UUID, "xid", xid=43, gpu_instance_id=9, compute_instance_id=0)
    assert policy.classify(app_error) is Verdict.IGNORED  # an application Xid stays ignored
    assert attributed_instance(xid(79)) is None
    # NVML attributes only Xid events: anything else is about the whole GPU.
    assert attributed_instance(HealthEvent(UUID, "ecc-dbe", gpu_instance_id=9)) is None
    assert attributed_instance(HealthEvent(UUID, "recovered", gpu_instance_id=9)) is None
