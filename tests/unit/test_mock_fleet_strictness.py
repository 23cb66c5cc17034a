"""The fleet decoder is strict (msgspec, `strict=True`): no coercion, unknown fields
refused, bounds checked, and the problem named by its field path."""

from __future__ import annotations

import pytest

from driver.nvml.mock.fleet import FleetError, parse_fleet


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpus": [{"model": "H100-80GB", "count": True}]}, "gpus[0].count: Expected `int`"),
        ({"gpus": [{"model": "H100-80GB", "count": 2.0}]}, "gpus[0].count: Expected `int`"),
        ({"gpus": [{"model": "H100-80GB", "count": "8"}]}, "gpus[0].count: Expected `int`"),
        ({"gpus": [{"model": 5}]}, "gpus[0].model: Expected `str`, got `int`"),
        (
            {"gpus": [{"model": "H100-80GB", "count": 1025}]},
            "gpus[0].count: Expected `int` <= 1024",
        ),
        ({"gpus": "H100-80GB"}, "gpus: Expected `array`, got `str`"),
        ({"gpus": [7]}, "gpus[0]: Expected `object`, got `int`"),
        (
            {"gpus": [{"model": "H100-80GB", "migInstances": [{"start": 0}]}]},
            "gpus[0].migInstances[0].profile: missing required field",
        ),
        ({"gpus": [{"model": "H100-80GB", "colour": "green"}]}, "gpus[0].colour: unknown field"),
        ({"gpus": [{"model": "H100-80GB"}], "x": 1}, "x: unknown field"),
        ({"gpus": [{"model": "H100-80GB"}], "driverVersion": ""}, "driverVersion: Expected `str`"),
    ],
)
def test_wrong_types_and_bounds_name_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(FleetError, match=r"^fleet: ") as err:
        parse_fleet(data)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_valid_fleet_keeps_its_defaults() -> None:
    fleet = parse_fleet({"gpus": [{"model": "example"}]})
    (group,) = fleet.gpus
    assert (group.count, group.migMode, group.migInstances) == (1, None, ())
    assert fleet.resolved_driver_version == "1.0.0"
