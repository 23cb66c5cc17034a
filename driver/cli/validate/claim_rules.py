"""What `gpu-dra validate` checks in a claim beyond each GpuConfig on its own: what its
requests and configs name. Each of these problems leaves a claim pending, refused by
the API server, or failing at every prepare, while each GpuConfig in it is valid.

- Device classes. A request's `deviceClassName` must be a class of the driver (the
  chart's `<driver>`, `mig.<driver>` and `partition.<driver>`, the names given with
  `--device-class`, a DeviceClass in the given files that selects the driver's devices
  or configures them) or a DeviceClass of another driver in the given files. A name close
  to one of the driver's (a likely misspelling) is reported; in a claim for the driver
  any other unknown name is another driver's class the tool cannot know (a GPU and a
  NIC in one claim): not checked, and said so in a note (`class_notes`).
- Request names. Each name in a config's `requests` must be a request (`gpu`) or a
  sub-request (`gpu/small`) of the claim: the API server refuses the claim otherwise.
- Opaque drivers. An opaque config for another driver must apply to some request
  that driver can serve: one whose class is not the driver's. Otherwise (a misspelt
  `driver:`) no driver ever reads it and the webhook never sees it.
- SpacePartitioning. For each request, the config that applies at prepare (the claim's
  last config of the driver naming it or naming none) must not be SpacePartitioning on a
  partition class (`mig.<driver>`, `partition.<driver>`): prepare never splits a
  partition. With `--slices`, some published device the request's class selects
  (`DeviceClasses.offered`) must take it at prepare (`driver.config.validate_for_device`:
  a whole GPU not shared by capacity whose `maxPartitions`, if published, is at least
  `partitionCount`).
- Time-slice intervals. A non-Default `timeSlicingConfig.interval` must not apply to a
  request of `mig.<driver>`: a MIG device has no interval, and prepare refuses it. With
  `--slices`, nor to a request of the driver's class whose every published device the
  class selects is a MIG device (a MIG partition, or the whole GPU of a GPU in MIG mode,
  with `migProfile`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from driver.cli.validate.claim_requests import (
    ClaimConfig,
    DeviceRequest,
    claim_configs,
    device_requests,
    request_names,
)
from driver.cli.validate.slice_devices import GPU_PARTITION_ATTRIBUTE, MIG_ATTRIBUTE, OfferedDevice
from driver.config import (
    CONFIG_LIST_PATHS,
    ConfigError,
    GpuConfig,
    Interval,
    Strategy,
    request_matches,
)
from driver.config import validate_for_device as device_rule
from driver.config.config_error import FieldError
from driver.config.document_checks import config_list_of
from driver.config.opaque import opaque_parameters_errors

#: How alike (difflib ratio) an unknown class name and one of the driver's must be to
#: be reported in a claim not otherwise for the driver: `gpu.exmaple.com` (0.93) is,
#: another driver's `nic.example.com` (0.80) is not.
MISSPELLING_CUTOFF = 0.85


def chart_classes(driver: str) -> dict[str, str | None]:
    """The chart's DeviceClasses for `driver`, each with the attribute its selector
    requires of a device (None: whole GPUs, which have neither)."""
    return {
        driver: None,
        f"mig.{driver}": MIG_ATTRIBUTE,
        f"partition.{driver}": GPU_PARTITION_ATTRIBUTE,
    }


@dataclass(frozen=True)
class DeviceClasses:
    """The DeviceClass names claims may use, and whose they are."""

    driver: str
    ours: tuple[str, ...]  # the driver's, the chart's first
    others: frozenset[str]  # DeviceClasses of other drivers in the given files

    @classmethod
    def of(cls, driver: str, extra: Iterable[str], documents: Iterable[object]) -> DeviceClasses:
        """The chart's classes for `driver`, `extra` (--device-class), and the
        DeviceClass documents among `documents`."""
        ours = [*chart_classes(driver), *extra]
        others: set[str] = set()
        for doc in documents:
            name = _device_class_name(doc)
            if name is None or not isinstance(doc, Mapping):
                continue
            if _selects_driver(doc, driver):
                ours.append(name)
            else:
                others.add(name)
        return cls(driver, tuple(dict.fromkeys(ours)), frozenset(others))

    def is_ours(self, name: object) -> bool:
        return name in self.ours

    def gives_partitions(self, name: object) -> bool:
        """Whether `name` is a chart class of partitions only (MIG or --gpu-partitions)."""
        return chart_classes(self.driver).get(str(name)) is not None

    def gives_mig(self, name: object) -> bool:
        """Whether `name` is the chart's class of MIG devices."""
        return chart_classes(self.driver).get(str(name)) == MIG_ATTRIBUTE

    def offered(self, name: object, devices: list[OfferedDevice]) -> list[OfferedDevice]:
        """The devices a request of class `name` may get: for the chart's classes those
        their selectors pick (whole GPUs, MIG partitions, `--gpu-partitions` partitions);
        for any other class all of them."""
        chart = chart_classes(self.driver)
        if not isinstance(name, str) or name not in chart:
            return devices
        return [d for d in devices if d.partition_attribute == chart[name]]


def _device_class_name(doc: object) -> str | None:
    if not isinstance(doc, Mapping) or doc.get("kind") != "DeviceClass":
        return None
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) and name else None


def _selects_driver(doc: Mapping[str, object], driver: str) -> bool:
    """Whether a DeviceClass configures `driver`'s devices or names the driver in a
    CEL selector (`device.driver == '<driver>'`)."""
    configs = config_list_of(doc, "DeviceClass")
    for entry in configs if isinstance(configs, list) else []:
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if isinstance(opaque, Mapping) and opaque.get("driver") == driver:
            return True
    spec = doc.get("spec")
    selectors = spec.get("selectors") if isinstance(spec, Mapping) else None
    for selector in selectors if isinstance(selectors, list) else []:
        cel = selector.get("cel") if isinstance(selector, Mapping) else None
        expression = cel.get("expression") if isinstance(cel, Mapping) else None
        if isinstance(expression, str) and any(q + driver + q in expression for q in "'\""):
            return True
    return False


def is_for_driver(doc: object, classes: DeviceClasses) -> bool:
    """Whether a claim document asks for a class of the driver or configures it, or a
    DeviceClass document is one of the driver's."""
    if not isinstance(doc, Mapping) or doc.get("kind") not in CONFIG_LIST_PATHS:
        return False
    if doc.get("kind") == "DeviceClass":
        return classes.is_ours(_device_class_name(doc))
    return any(classes.is_ours(r.device_class) for r in device_requests(doc)) or any(
        config.driver == classes.driver for config in claim_configs(doc)
    )


def claim_problems(
    doc: object, classes: DeviceClasses, devices: list[OfferedDevice] | None
) -> list[FieldError]:
    """Every problem of the rules above in one claim document; `devices`: those of the
    driver in the --slices files, None without them."""
    requests = device_requests(doc)
    if not requests:
        return []
    for_driver = is_for_driver(doc, classes)
    problems = list(_class_problems(requests, classes, for_driver))
    if for_driver:
        problems += _request_name_problems(requests, claim_configs(doc))
        problems += _unreachable_driver_problems(requests, claim_configs(doc), classes)
        problems += _sharing_problems(doc, requests, classes, devices)
    return problems


def _class_problems(
    requests: list[DeviceRequest], classes: DeviceClasses, for_driver: bool
) -> Iterator[FieldError]:
    for request in requests:
        name = request.device_class
        path = f"{request.path}.deviceClassName"
        if not isinstance(name, str) or not name:
            if for_driver:
                yield FieldError(path, "required field missing")
            continue
        if classes.is_ours(name) or name in classes.others:
            continue
        close = _close_class(name, classes)
        if close is None:
            continue  # another driver's, or a note (class_notes)
        yield FieldError(
            path,
            f"unknown device class '{name}' (did you mean '{close}'?); the classes of "
            f"{classes.driver} are {', '.join(classes.ours)}; --device-class adds others",
        )


def _close_class(name: str, classes: DeviceClasses) -> str | None:
    """The driver's class that `name` is a likely misspelling of, or None."""
    close = difflib.get_close_matches(name, classes.ours, n=1, cutoff=MISSPELLING_CUTOFF)
    return close[0] if close else None


def class_notes(doc: object, classes: DeviceClasses) -> list[FieldError]:
    """In a claim for the driver, each request's class that is neither the driver's, nor
    a DeviceClass in the given files, nor a likely misspelling of one of the driver's:
    another driver's class, which the tool cannot know. Only the driver's classes are
    checked; these are named, not reported as problems."""
    requests = device_requests(doc)
    if not requests or not is_for_driver(doc, classes):
        return []
    notes = []
    for request in requests:
        name = request.device_class
        if not isinstance(name, str) or not name or classes.is_ours(name):
            continue
        if name in classes.others or _close_class(name, classes) is not None:
            continue
        notes.append(
            FieldError(
                f"{request.path}.deviceClassName",
                f"device class '{name}' not checked: not a class of {classes.driver} "
                f"({', '.join(classes.ours)}; --device-class adds others) nor a DeviceClass "
                "in the given files",
            )
        )
    return notes


def _request_name_problems(
    requests: list[DeviceRequest], configs: list[ClaimConfig]
) -> Iterator[FieldError]:
    names = request_names(requests)
    for config in configs:
        for index, name in enumerate(config.requests):
            if name not in names:
                yield FieldError(
                    f"{config.path}.requests[{index}]",
                    f"no request '{name}' in this claim (requests: {', '.join(names)})",
                )


def _applies_to(config: ClaimConfig, request: DeviceRequest) -> bool:
    return not config.requests or any(request_matches(n, request.name) for n in config.requests)


def _unreachable_driver_problems(
    requests: list[DeviceRequest], configs: list[ClaimConfig], classes: DeviceClasses
) -> Iterator[FieldError]:
    """Opaque configs of another driver whose every request is of the driver's classes."""
    for config in configs:
        if not isinstance(config.driver, str) or config.driver == classes.driver:
            continue
        targets = [r for r in requests if _applies_to(config, r)]
        if not targets or not all(classes.is_ours(r.device_class) for r in targets):
            continue
        close = difflib.get_close_matches(
            config.driver, [classes.driver], n=1, cutoff=MISSPELLING_CUTOFF
        )
        guess = f" (did you mean '{close[0]}'?)" if close else ""
        served = ", ".join(f"{r.name}: class {r.device_class}" for r in targets)
        yield FieldError(
            f"{config.path}.opaque.driver",
            f"'{config.driver}' is the driver of no request it applies to ({served}), "
            f"so no driver ever reads it{guess}",
        )


def _effective_configs(
    doc: object, requests: list[DeviceRequest], driver: str
) -> Iterator[tuple[DeviceRequest, ClaimConfig, GpuConfig]]:
    """Each request with the claim config of `driver` that prepare applies to it (the
    last valid one naming it or naming none; `driver.config.resolve_configs`)."""
    decoded: list[tuple[ClaimConfig, GpuConfig]] = []
    for config in claim_configs(doc):
        if config.driver == driver:
            gpu_config, _ = opaque_parameters_errors(config.parameters, "")
            if gpu_config is not None:
                decoded.append((config, gpu_config))
    for request in requests:
        applying = [
            (config, gpu_config) for config, gpu_config in decoded if _applies_to(config, request)
        ]
        if applying:
            yield request, *applying[-1]


def _sharing_problems(
    doc: object,
    requests: list[DeviceRequest],
    classes: DeviceClasses,
    devices: list[OfferedDevice] | None,
) -> Iterator[FieldError]:
    for request, config, gpu_config in _effective_configs(doc, requests, classes.driver):
        parameters = f"{config.path}.opaque.parameters"
        device_class = request.device_class
        interval_refusal = _interval_refusal(request, gpu_config, classes, devices)
        if interval_refusal is not None:
            yield FieldError(f"{parameters}.sharing.timeSlicingConfig.interval", interval_refusal)
        if gpu_config.strategy != Strategy.SPACE_PARTITIONING:
            continue
        if classes.gives_partitions(device_class):
            yield FieldError(
                f"{parameters}.sharing.strategy",
                f"SpacePartitioning fails at prepare for request '{request.name}': class "
                f"{device_class} gives partitions, which cannot be split further; use "
                "TimeSlicing or no sharing config for it",
            )
        elif devices and classes.is_ours(device_class):
            refusal = _refused_everywhere(gpu_config, classes.offered(device_class, devices))
            if refusal is not None:
                yield FieldError(
                    f"{parameters}.{refusal.path}",
                    f"fails at prepare for request '{request.name}' on every device of class "
                    f"{device_class} in the given slices ({refusal.message})",
                )


def _interval_refusal(
    request: DeviceRequest,
    config: GpuConfig,
    classes: DeviceClasses,
    devices: list[OfferedDevice] | None,
) -> str | None:
    """Why prepare refuses the config's time-slice interval on every device the request
    may get (each a MIG device, `driver.state.plan._no_time_slice`), or None."""
    interval, device_class = config.interval, request.device_class
    if interval in (None, Interval.DEFAULT):
        return None
    if classes.gives_mig(device_class):
        return (
            f"{interval} fails at prepare for request '{request.name}': class "
            f"{device_class} gives MIG devices, which have no time-slice interval; use a "
            "GPU with MIG mode off, or no interval"
        )
    offered = classes.offered(device_class, devices or []) if classes.is_ours(device_class) else []
    if not offered or not all(d.mig for d in offered):
        return None
    more = ", ..." if len(offered) > 1 else ""
    return (
        f"{interval} fails at prepare for request '{request.name}' on every device of class "
        f"{device_class} in the given slices (each is a MIG device, which has no time-slice "
        f"interval: {offered[0].where()}{more}); use a GPU with MIG mode off, or no interval"
    )


def _refused_everywhere(config: GpuConfig, devices: list[OfferedDevice]) -> FieldError | None:
    """None if some device takes `config` at prepare (or there is none); else the field
    every device refuses and why, told by the device that came closest."""
    if not devices:
        return None
    refusals: list[FieldError] = []  # one per device, in order
    for device in devices:
        try:
            device_rule(
                config,
                device_name=device.name,
                is_partition=device.is_partition,
                max_partitions=device.max_partitions,
                share=device.shared,
            )
        except ConfigError as err:
            refusals.append(err.errors[0])
        else:
            return None
    whole = [d for d in devices if not d.is_partition]
    unshared = [d for d in whole if not d.shared]
    if unshared:
        best = max(unshared, key=lambda d: d.max_partitions or 0)
        why = f"largest maxPartitions: {best.max_partitions}, {best.where()}"
    elif whole:
        best = whole[0]
        why = "every whole GPU is shared by capacity (allowMultipleAllocations), never split"
    else:
        best = devices[0]
        why = "all of them are partitions"
    return FieldError(refusals[devices.index(best)].path, why)
