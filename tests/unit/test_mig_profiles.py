"""`--mig-profiles` (MIG_PROFILES, chart `kubeletPlugin.migProfiles`, node label
`<driver>/mig-profiles`): a dynamic-MIG GPU publishes the placements of the selected
profiles only, the whole GPU either way; a profile a GPU does not offer stops the
start with one line naming the GPU and its profiles."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from driver.devices import slices as sl
from driver.devices.model import PoolError, PoolOptions, build_pool
from driver.kube.api import ApiError
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.plugin.options.node_overrides import node_mig_profiles
from driver.plugin.options.settings import MIG_PROFILES, SettingError, read_settings
from tests.unit.test_chart_render import env_of, helm_template, plugin_container, render

THREE = ("1g10gb", "3g40gb", "7g80gb")


def _pool(profiles: tuple[str, ...] = ()) -> Any:
    inventory = MockBackend(MockNvml(default_fleet(), "n1")).discover()
    return build_pool(inventory, PoolOptions(mig_profiles=profiles))


def test_a_selection_publishes_its_profiles_placements_and_the_whole_gpu() -> None:
    every, selected = _pool(), _pool(THREE)
    gpu0 = sorted(d.name for d in selected.devices if d.gpu_minor == 0)
    assert gpu0 == sorted(
        ["gpu-0", "gpu-0-mig-7g80gb-0", "gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"]
        + [f"gpu-0-mig-1g10gb-{start}" for start in range(7)]
    )
    assert len(selected.devices) == 8 * 11 < len(every.devices) == 8 * 26
    specs = sl.build_slice_specs(selected, driver="gpu.example.com", node_name="n1")
    assert sl.validate_slice_specs(specs) == []
    # The selected devices are the same documents as without a selection but for the
    # counters they consume: no two selected placements need the one OFA engine, so
    # only memory is counted, in blocks of slices (docs/mig.md, "Slice layout"): as
    # much of it as the device's placement spans.
    documents = {d.name: d.document for d in every.devices}
    for device in selected.devices:
        consumption = device.document["consumesCounters"][0]["counters"]
        assert {**device.document, "consumesCounters": None} == {
            **documents[device.name],
            "consumesCounters": None,
        }
        assert all(k.startswith("memory-slice") for k in consumption)
        assert sum(int(v["value"]) for v in consumption.values()) == len(
            [
                k
                for k in documents[device.name]["consumesCounters"][0]["counters"]
                if k.startswith("memory-slice-")
            ]
        )


def test_a_profile_the_gpu_does_not_offer_is_one_line_naming_its_profiles() -> None:
    with pytest.raises(PoolError) as err:
        _pool(("1g10gb", "1g5gb"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--mig-profiles: GPU 0 (NVIDIA H100 80GB HBM3, GPU-")
    assert "has no MIG profile 1g5gb; its profiles: 1g.10gb, " in message


@pytest.mark.parametrize(
    ("text", "profiles"),
    [
        ("1g.10gb,3g.40gb,7g.80gb", THREE),
        ("1g10gb_3g40gb_7g80gb", THREE),
        ("1G.10GB, 1g10gb", ("1g10gb",)),
        ("1g.10gb+me", ("1g10gb-me",)),
        ("", ()),
    ],
)
def test_the_setting_reads_names_and_labels(
    text: str, profiles: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MIG_PROFILES", text)
    assert read_settings(argparse.Namespace(), [MIG_PROFILES])["mig_profiles"] == profiles
    flag = argparse.Namespace(mig_profiles="7g.80gb")  # the flag wins over the variable
    assert read_settings(flag, [MIG_PROFILES])["mig_profiles"] == ("7g80gb",)


def test_a_bad_profile_names_the_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIG_PROFILES", "10gb")
    with pytest.raises(SettingError, match=r"--mig-profiles \(env MIG_PROFILES\).*'10gb'"):
        read_settings(argparse.Namespace(), [MIG_PROFILES])


class Api:
    def __init__(self, labels: dict[str, str] | None = None, error: Exception | None = None):
        self.labels, self.error = labels or {}, error
        self.paths: list[str] = []

    def request(self, method: str, path: str) -> object:
        self.paths.append(path)
        if self.error is not None:
            raise self.error
        return {"metadata": {"name": "n1", "labels": self.labels}}


def test_the_node_label_overrides_the_flag() -> None:
    api = Api({"gpu.example.com/mig-profiles": "1g10gb_3g40gb"})
    assert node_mig_profiles(api, "n1", "gpu.example.com") == ("1g10gb", "3g40gb")
    assert api.paths == ["/api/v1/nodes/n1"]
    assert node_mig_profiles(Api({"other/mig-profiles": "1g10gb"}), "n1", "gpu.example.com") is None


def test_a_bad_label_stops_the_start_and_an_unreadable_node_leaves_the_flag() -> None:
    with pytest.raises(SettingError, match=r"node label gpu.example.com/mig-profiles='2x'"):
        node_mig_profiles(Api({"gpu.example.com/mig-profiles": "2x"}), "n1", "gpu.example.com")
    forbidden = Api(error=ApiError(403, "Forbidden", "nodes is forbidden"))
    assert node_mig_profiles(forbidden, "n1", "gpu.example.com") is None


def test_the_chart_value_reaches_the_plugin() -> None:
    docs = render("--set", "kubeletPlugin.migProfiles=1g.10gb\\,3g.40gb")
    env = env_of(plugin_container(docs))
    assert env["MIG_PROFILES"]["value"] == "1g.10gb,3g.40gb"
    bad = helm_template("--set", "kubeletPlugin.migProfiles=all-of-them", check=False)
    assert bad.returncode != 0 and "migProfiles" in bad.stderr
