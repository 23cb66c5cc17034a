"""A reproduction of Go's math/rand v1 and the reference driver's UUID scheme.

The Go reference driver (dra-example-driver, `gpu` profile) derives one UUID per
device from `rand.New(rand.NewSource(seed))`, where the seed is a Java-style
string hash of the node name. Reproducing it bit for bit keeps published UUIDs
stable for clusters moving from the Go driver to this one.

Go's generator is an additive lagged-Fibonacci generator (lags 607 and 273)
seeded through the Park-Miller LCG (x * 48271 mod 2**31-1) XOR a fixed table,
`rngCooked`, which is generated from Go's sources by hack/gen-gorand-table.py.
"""

from __future__ import annotations

from driver.nvml.mock._gorand_table import RNG_COOKED

RNG_LEN = 607
RNG_TAP = 273
INT32_MAX = (1 << 31) - 1
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _to_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _seedrand(x: int) -> int:
    """One step of Go's seeding LCG: x * 48271 mod (2**31 - 1)."""
    hi, lo = divmod(x, 44488)
    x = 48271 * lo - 3399 * hi
    if x < 0:
        x += INT32_MAX
    return x


class GoRand:
    """Go `rand.New(rand.NewSource(seed))`: Int63, Uint64 and Read."""

    def __init__(self, seed: int) -> None:
        self._vec = [0] * RNG_LEN
        self._read_val = 0
        self._read_pos = 0
        self.seed(seed)

    def seed(self, seed: int) -> None:
        self._tap = 0
        self._feed = RNG_LEN - RNG_TAP
        seed = _to_int64(seed)
        # Go's % truncates toward zero.
        rem = abs(seed) % INT32_MAX
        seed = -rem if seed < 0 else rem
        if seed < 0:
            seed += INT32_MAX
        if seed == 0:
            seed = 89482311
        x = seed
        for i in range(-20, RNG_LEN):
            x = _seedrand(x)
            if i >= 0:
                u = _to_int64(x << 40)
                x = _seedrand(x)
                u ^= x << 20
                x = _seedrand(x)
                u ^= x
                u ^= RNG_COOKED[i]
                self._vec[i] = _to_int64(u)
        self._read_val = 0
        self._read_pos = 0

    def uint64(self) -> int:
        self._tap -= 1
        if self._tap < 0:
            self._tap += RNG_LEN
        self._feed -= 1
        if self._feed < 0:
            self._feed += RNG_LEN
        x = _to_int64(self._vec[self._feed] + self._vec[self._tap])
        self._vec[self._feed] = x
        return x & _MASK64

    def int63(self) -> int:
        return self.uint64() & _MASK63

    def read(self, n: int) -> bytes:
        """Go `(*Rand).Read`: 7 low bytes per Int63, LSB first; leftovers carry over."""
        out = bytearray()
        pos, val = self._read_pos, self._read_val
        for _ in range(n):
            if pos == 0:
                val = self.int63()
                pos = 7
            out.append(val & 0xFF)
            val >>= 8
            pos -= 1
        self._read_pos, self._read_val = pos, val
        return bytes(out)


def java_string_hash(text: str) -> int:
    """`h = 31*h + codepoint` over the string's code points, signed 64-bit wraparound."""
    h = 0
    for ch in text:
        h = _to_int64(31 * h + ord(ch))
    return h


def format_uuid(raw: bytes) -> str:
    """16 bytes as canonical lowercase 8-4-4-4-12 (no version/variant bits forced)."""
    if len(raw) != 16:
        raise ValueError(f"a UUID needs 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def reference_uuids(node_name: str, count: int, prefix: str = "gpu") -> list[str]:
    """The reference driver's deterministic device UUIDs for a node, in device order."""
    rng = GoRand(java_string_hash(node_name))
    return [f"{prefix}-{format_uuid(rng.read(16))}" for _ in range(count)]
