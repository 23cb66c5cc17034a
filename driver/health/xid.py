"""Xid classification: which NVML health events make a GPU unusable.

Application Xids (a fault of the workload, not of the GPU) are ignored by default:
13, 31, 43, 45, 68, 109. `--additional-xids-to-ignore` adds to that list,
`--fatal-xids` forces Xids fatal and wins over every ignore list. A double-bit ECC
error and a lost GPU are always fatal.

The verdict depends on the Xid alone, not on where it happened; where (the whole
GPU, or one MIG GPU instance NVML attributes it to: `attributed_instance`) decides
which devices a fatal one taints.

Both flags take a comma-separated list of Xids, or `all`:
`--additional-xids-to-ignore=all` ignores every Xid except those in `--fatal-xids`
("Xid health checks off except N"); `--fatal-xids=all` ignores nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from driver.nvml.discovered import HealthEvent

DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
ALL = "all"
MAX_XID = 0xFFFFFFFF  # NVML reports the Xid as an unsigned 32-bit value

IGNORE_FLAG = "--additional-xids-to-ignore"
FATAL_FLAG = "--fatal-xids"
EFFECT_FLAG = "--xid-taint-effect"

TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")
DEFAULT_TAINT_EFFECT = "NoSchedule"
# The scheduler ignores a taint with this effect, so prepare does not refuse the device.
INFORMATIONAL_EFFECT = "None"


class Verdict(enum.Enum):
    FATAL = "fatal"
    IGNORED = "ignored"


class XidListError(ValueError):
    """A malformed flag value; the message names the flag."""


@dataclass(frozen=True)
class XidList:
    """A parsed Xid list flag: explicit Xids, or every Xid."""

    xids: frozenset[int] = frozenset()
    all: bool = False

    def __contains__(self, xid: object) -> bool:
        return self.all or xid in self.xids


def parse_xid_list(text: str | None, flag: str) -> XidList:
    """`"79, 48"` -> XidList({48, 79}); `"all"` -> XidList(all=True); `""` -> empty.

    Raises XidListError naming `flag` and the offending item.
    """
    if text is None or not text.strip():
        return XidList()
    xids: set[int] = set()
    every = False
    for position, raw in enumerate(text.split(","), start=1):
        item = raw.strip()
        if not item:
            raise XidListError(f"{flag}: item {position} is empty in {text!r}")
        if item.lower() == ALL:
            every = True
            continue
        try:
            value = int(item, 10)
        except ValueError:
            raise XidListError(
                f"{flag}: {item!r} is not an Xid (expected comma-separated decimal numbers, "
                f"or {ALL!r})"
            ) from None
        if not 0 < value <= MAX_XID:
            raise XidListError(f"{flag}: Xid {value} is out of range (1..{MAX_XID})")
        xids.add(value)
    return XidList(frozenset(xids), every)


def parse_taint_effect(text: str | None, flag: str = EFFECT_FLAG) -> str:
    """`NoSchedule` | `NoExecute` | `None` (case-insensitive), normalised."""
    if text is None or not text.strip():
        return DEFAULT_TAINT_EFFECT
    effect = {e.lower(): e for e in TAINT_EFFECTS}.get(text.strip().lower())
    if effect is not None:
        return effect
    raise XidListError(f"{flag}: {text!r} is not one of {', '.join(TAINT_EFFECTS)}")


@dataclass(frozen=True)
class XidPolicy:
    """Decides fatal vs ignored for one health event."""

    ignored: XidList = XidList(DEFAULT_IGNORED_XIDS)
    fatal: XidList = XidList()

    @classmethod
    def from_flags(
        cls,
        additional_ignored: str | Iterable[int] | None = None,
        fatal: str | Iterable[int] | None = None,
    ) -> XidPolicy:
        """The policy for `--additional-xids-to-ignore` and `--fatal-xids` values (strings
        as given on the command line, or ints). Raises XidListError naming the flag."""
        extra = _as_list(additional_ignored, IGNORE_FLAG)
        return cls(
            XidList(DEFAULT_IGNORED_XIDS | extra.xids, extra.all), _as_list(fatal, FATAL_FLAG)
        )

    def classify(self, event: HealthEvent) -> Verdict:
        """Fatal or ignored. `recovered` (and unknown kinds) are never failures."""
        if event.kind in ("ecc-dbe", "gpu-lost"):
            return Verdict.FATAL
        if event.kind != "xid":
            return Verdict.IGNORED
        # An Xid event without a number cannot be judged benign.
        if event.xid is None or event.xid in self.fatal or event.xid not in self.ignored:
            return Verdict.FATAL
        return Verdict.IGNORED

    def describe(self) -> str:
        def show(xids: XidList) -> str:
            items = [str(x) for x in sorted(xids.xids)]
            if xids.all:
                items.insert(0, ALL)
            return ",".join(items) or "-"

        return f"ignored Xids: {show(self.ignored)}; fatal Xids: {show(self.fatal)}"


def attributed_instance(event: HealthEvent) -> int | None:
    """The MIG GPU instance an Xid event is attributed to, or None when the event
    concerns the whole GPU. NVML attributes only Xid events (nvml.h, nvmlEventData_t),
    so any other kind is whole-GPU whatever it carries."""
    return event.gpu_instance_id if event.kind == "xid" else None


def _as_list(value: str | Iterable[int] | None, flag: str) -> XidList:
    if value is None or isinstance(value, str):
        return parse_xid_list(value, flag)
    return parse_xid_list(",".join(str(int(v)) for v in value), flag)
