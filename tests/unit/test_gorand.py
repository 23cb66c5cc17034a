"""Go math/rand v1 reproduction and the reference driver's UUIDs (example-driver.md §2.6)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from driver.nvml.mock import gorand
from driver.nvml.mock._gorand_table import RNG_COOKED

REPO = Path(__file__).resolve().parents[2]

WORKER_UUIDS = [
    "gpu-18db0e85-99e9-c746-8531-ffeb86328b39",
    "gpu-93d37703-997c-c46f-a531-755e3e0dc2ac",
    "gpu-ee3e4b55-fcda-44b8-0605-64b7a9967744",
    "gpu-9ede7e32-5825-a11b-fa3d-bab6d47e0243",
    "gpu-e7b42cb1-4fd8-91b2-bc77-352a0c1f5747",
    "gpu-f11773a1-5bfb-e48b-3d98-1beb5baaf08e",
    "gpu-0159f35e-99ee-b2b5-74f1-9d18df3f22ac",
    "gpu-657bd2e7-f5c2-a7f2-fbaa-0d1cdc32f81b",
]


def test_java_string_hash_of_reference_node() -> None:
    assert gorand.java_string_hash("dra-example-driver-cluster-worker") == 3957047767310442521


def test_java_string_hash_wraps_and_uses_code_points() -> None:
    assert gorand.java_string_hash("") == 0
    assert gorand.java_string_hash("a") == 97
    assert gorand.java_string_hash("ab") == 31 * 97 + 98
    # A long name overflows int64 several times and stays signed 64-bit.
    h = gorand.java_string_hash("x" * 100)
    assert -(1 << 63) <= h < (1 << 63)
    assert gorand.java_string_hash("é") == 0xE9


def test_reference_worker_uuids() -> None:
    assert gorand.reference_uuids("dra-example-driver-cluster-worker", 8) == WORKER_UUIDS


def test_reference_test_node_uuids() -> None:
    assert gorand.reference_uuids("test-node", 2) == [
        "gpu-69d96e09-3a81-6655-a411-e2a85dbf4b80",
        "gpu-2bd3a17a-271e-7d9a-a8a2-2c01d857dc38",
    ]


def test_reference_single_device_nodes() -> None:
    assert gorand.reference_uuids("node-1", 1) == ["gpu-7bad7559-1636-cf0a-d725-6b33c29a8680"]
    assert gorand.reference_uuids("node-2", 1) == ["gpu-5832cbd3-db05-1439-f264-3243032cbed9"]


def test_prefix_and_prefix_independence() -> None:
    nets = gorand.reference_uuids("test-node", 2, prefix="net")
    gpus = gorand.reference_uuids("test-node", 2)
    assert [n.removeprefix("net-") for n in nets] == [g.removeprefix("gpu-") for g in gpus]


def test_uuid_sequence_is_a_prefix_of_longer_sequences() -> None:
    # Leftover bytes carry between devices, so n devices are the first n of n+k.
    assert gorand.reference_uuids("dra-example-driver-cluster-worker", 3) == WORKER_UUIDS[:3]


# Values printed by Go 1.26 `rand.New(rand.NewSource(s))`: Int63, Int63, Uint64.
GO_OUTPUTS = {
    0: (8717895732742165505, 2259404117704393152, 6050128673802995827),
    1: (5577006791947779410, 8674665223082153551, 15352856648520921629),
    -1: (3644962268338389676, 550171362161912239, 3094056749125766625),
    2147483647: (8717895732742165505, 2259404117704393152, 6050128673802995827),
    -(1 << 63): (7681445645332086223, 6777158040660201103, 17971378070088983720),
}


@pytest.mark.parametrize("seed", sorted(GO_OUTPUTS))
def test_matches_go_outputs(seed: int) -> None:
    rng = gorand.GoRand(seed)
    assert (rng.int63(), rng.int63(), rng.uint64()) == GO_OUTPUTS[seed]


def test_read_takes_seven_bytes_per_int63_lsb_first() -> None:
    a = gorand.GoRand(1)
    first = a.int63()
    second = a.int63()
    b = gorand.GoRand(1)
    data = b.read(10)
    assert data[:7] == first.to_bytes(8, "little")[:7]
    assert data[7:10] == second.to_bytes(8, "little")[:3]
    # The remaining 4 bytes of `second` are served before a new value is drawn.
    assert b.read(4) == second.to_bytes(8, "little")[3:7]


def test_format_uuid_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        gorand.format_uuid(b"\x00" * 15)
    assert gorand.format_uuid(bytes(range(16))) == "00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_table_shape() -> None:
    assert len(RNG_COOKED) == 607
    assert all(-(1 << 63) <= v < (1 << 63) for v in RNG_COOKED)
    assert RNG_COOKED[0] == -4181792142133755926


def _load_generator() -> object:
    spec = importlib.util.spec_from_file_location("gen_gorand", REPO / "hack/gen-gorand-table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_extracts_table_from_go_source_text() -> None:
    gen = _load_generator()
    values = list(range(-300, 307))
    body = ", ".join(str(v) for v in values)
    text = f"var (\n\trngCooked [rngLen]int64 = [...]int64{{\n\t\t{body},\n\t}}\n)\n"
    assert gen.extract(text) == values  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        gen.extract(text.replace("-300, ", ""))  # type: ignore[attr-defined]


def test_generated_module_is_current() -> None:
    goroot = subprocess.run(["go", "env", "GOROOT"], capture_output=True, text=True, check=True)
    rng_go = Path(goroot.stdout.strip()) / "src/math/rand/rng.go"
    assert rng_go.exists(), f"Go sources missing: {rng_go}"
    result = subprocess.run(
        [sys.executable, str(REPO / "hack/gen-gorand-table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
