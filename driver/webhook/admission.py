"""AdmissionReview handling (pure logic, no I/O).

Validates the GpuConfigs in ResourceClaims and ResourceClaimTemplates of
resource.k8s.io v1, v1beta1 and v1beta2 (the config list has the same shape and
path in all three: `spec.devices.config` / `spec.spec.devices.config`). Configs are
decoded with the same strict decoder, defaults and static rules as the plugin, so
the webhook admits exactly what the plugin will accept (divergence from the
reference webhook, which validated without defaults).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from driver.config import FieldError, config_list_of, validate_object_configs

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"
RESOURCE_GROUP: Final = "resource.k8s.io"
VERSIONS: Final = ("v1", "v1beta1", "v1beta2")
MAX_REPORTED_ERRORS: Final = 20
# The API server sends a UUID. The uid is echoed into the answer and the log, so nothing
# but a short identifier is: a 1.5 M-character uid of `é` made a 9 MiB answer.
MAX_UID_LENGTH: Final = 128
UID_PATTERN: Final = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_UID_LENGTH - 1}}}")
#: plural resource -> kind, for the resources this webhook validates
RESOURCES: Final = {
    "resourceclaims": "ResourceClaim",
    "resourceclaimtemplates": "ResourceClaimTemplate",
}


class BadReview(ValueError):
    """The body is not an admission.k8s.io/v1 AdmissionReview request (HTTP 400)."""


def _deny(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "allowed": False,
        "status": {"status": "Failure", "code": code, "reason": reason, "message": message},
    }


def admit(request: Mapping[str, Any], driver_name: str) -> dict[str, Any]:
    """The `response` fields (without `uid`) for one admission request."""
    resource = request.get("resource")
    if not isinstance(resource, Mapping):
        resource = {}
    gvr = (resource.get("group"), resource.get("version"), resource.get("resource"))
    kind = RESOURCES.get(gvr[2]) if isinstance(gvr[2], str) else None
    if gvr[0] != RESOURCE_GROUP or gvr[1] not in VERSIONS or kind is None:
        expected = ", ".join(f"{{{RESOURCE_GROUP} {v} {r}}}" for v in VERSIONS for r in RESOURCES)
        message = f"expected resource to be one of [{expected}], got {{{gvr[0]} {gvr[1]} {gvr[2]}}}"
        return _deny(400, "BadRequest", message)
    if request.get("subResource"):
        return {"allowed": True}  # e.g. resourceclaims/status: the spec cannot change
    obj = request.get("object")
    if obj is None:
        return {"allowed": True}  # DELETE: nothing to validate
    old = request.get("oldObject")
    if old is not None and config_list_of(old, kind) == config_list_of(obj, kind):
        # The spec is immutable; never block metadata updates (finalizers!) of an
        # object that was admitted before this webhook (or this version) existed.
        return {"allowed": True}
    errors = validate_object_configs(obj, kind, driver_name)
    if not errors:
        return {"allowed": True}
    return _deny(422, "Invalid", deny_message(errors))


def deny_message(errors: list[FieldError]) -> str:
    """One line naming every bad field, or the first `MAX_REPORTED_ERRORS` of them (the
    API server shows it to the user; a forged review can carry thousands)."""
    configs = {e.path.split(".opaque.", 1)[0] for e in errors}
    noun = "config" if len(configs) == 1 else "configs"
    shown = "; ".join(str(e) for e in errors[:MAX_REPORTED_ERRORS])
    if len(errors) > MAX_REPORTED_ERRORS:
        shown += f"; and {len(errors) - MAX_REPORTED_ERRORS} more"
    return f"{len(configs)} {noun} failed to validate: {shown}"


def review(body: object, driver_name: str) -> dict[str, Any]:
    """Answer an AdmissionReview (already parsed JSON; parse it with
    `driver.config.loads_json` so duplicate keys are reported). Raises `BadReview`."""
    if not isinstance(body, Mapping):
        raise BadReview("AdmissionReview must be a JSON object")
    if body.get("apiVersion") != ADMISSION_API_VERSION or body.get("kind") != "AdmissionReview":
        raise BadReview(
            f"expected apiVersion {ADMISSION_API_VERSION} kind AdmissionReview, "
            f"got apiVersion {body.get('apiVersion')!r} kind {body.get('kind')!r}"
        )
    request = body.get("request")
    if not isinstance(request, Mapping):
        raise BadReview("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("AdmissionReview request has no uid")
    if not UID_PATTERN.fullmatch(uid):
        raise BadReview(
            f"AdmissionReview request.uid is not a UID: at most {MAX_UID_LENGTH} ASCII "
            "letters, digits, '.', '_', ':' and '-', starting with a letter or digit"
        )
    response = {"uid": uid, **admit(request, driver_name)}
    return {"apiVersion": ADMISSION_API_VERSION, "kind": "AdmissionReview", "response": response}
