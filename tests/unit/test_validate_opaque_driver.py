"""`gpu-dra validate`: an opaque config whose `driver` no request of the claim can reach
(a misspelt driver name) is never sent to the driver nor seen by its webhook."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_validate_claims import DRIVER, request, space_config, template, write
from tests.unit.test_validate_cli import problems, run_cli


def test_a_misspelt_opaque_driver_is_reported(tmp_path: Path) -> None:
    config = space_config(2, driver="gpu.exmaple.com")
    claim = write(tmp_path, template([request("gpu")], [config]))
    code, out, err = run_cli(str(claim))
    assert (code, out) == (1, "")
    assert problems(err) == [
        f"{claim}: ResourceClaimTemplate/t: spec.spec.devices.config[0].opaque.driver: "
        f"'gpu.exmaple.com' is the driver of no request it applies to (gpu: class {DRIVER}), "
        f"so no driver ever reads it (did you mean '{DRIVER}'?)"
    ]


def test_a_config_for_a_request_of_another_drivers_class_passes(tmp_path: Path) -> None:
    nics = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "nics"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'nic.example.com'"}}]},
    }
    config = space_config(2, ["nic"], driver="nic.example.com")
    claim = write(tmp_path, nics, template([request("gpu"), request("nic", "nics")], [config]))
    code, _, err = run_cli(str(claim))
    assert (code, problems(err)) == (0, [])
