"""What a pod that can reach the webhook cannot do to it (docs/security.md, "Webhook").

Refused input: `opaque.parameters` that is not a JSON object (the API server never
sends one; a string was parsed as YAML, whose aliases made an 829-byte request cost
minutes of CPU), YAML documents whose aliases expand past a bound or point into
themselves, configs of thousands of fields. Bounded server: the request deadline
(dribbling does not extend it), the connection limit and the buffered-bytes budget,
each with a legitimate review still answered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_webhook import Served, admission, claim, config, make_cert

from driver.config import (
    API_VERSION,
    KIND,
    ConfigError,
    FieldError,
    LoadError,
    gpu_config_errors,
    load_yaml_documents,
    resolve_configs,
    validate_claim_document,
)
from driver.config.gpu import MAX_CONFIG_VALUES
from driver.config.loader import MAX_ALIAS_EXPANSION, KeyTrackingDict, find_raw_problems
from driver.webhook.admission import MAX_REPORTED_ERRORS, review
from driver.webhook.server import LIMITS, VALIDATE_PATH, WebhookServer

# Where today's fixes are missing, several of these would run for hours: fail instead.
pytestmark = pytest.mark.timeout(30)
# CPU seconds of the test's thread that refusing or walking a bomb may take: it takes
# milliseconds; expanding it, hours. CPU time, not wall-clock time: a busy machine
# delays the thread but does not make it use more CPU.
CPU_BUDGET = 1.0
# Seconds to wait for what the server does at once: only a regression waits this long.
EVENT_WAIT = 20.0

DRIVER = "gpu.example.com"
P = "spec.devices.config[0].opaque.parameters"
GOOD = {"apiVersion": API_VERSION, "kind": KIND, "sharing": {"strategy": "TimeSlicing"}}


def alias_bomb(depth: int) -> str:
    """YAML of a few hundred bytes whose last list reaches 2**depth leaves."""
    lines = [f"apiVersion: {API_VERSION}", f"kind: {KIND}", "l0: &l0 [x, x]"]
    lines += [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


def answer(parameters: object) -> dict[str, Any]:
    response: dict[str, Any] = review(
        admission(claim([config(parameters)]), "resourceclaims"), DRIVER
    )["response"]
    return response


# --- opaque.parameters must be a JSON object --------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "got"),
    [
        (json.dumps(GOOD), "a string"),  # a valid GpuConfig, as JSON text
        (alias_bomb(60), "a string"),  # never parsed, so never expanded
        ([GOOD], "an array"),
        (7, "a number"),
        (True, "a boolean"),
        (None, "null"),
    ],
    ids=["json-text", "alias-bomb", "array", "number", "boolean", "null"],
)
def test_non_object_parameters_are_denied_naming_the_field(parameters: object, got: str) -> None:
    began = time.thread_time()
    response = answer(parameters)
    assert time.thread_time() - began < CPU_BUDGET
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    assert response["status"]["message"] == (
        f"1 config failed to validate: {P}: must be a JSON object, got {got}"
    )


def test_object_parameters_are_still_admitted() -> None:
    assert answer(GOOD) == {"uid": "uid-1", "allowed": True}


def test_plugin_and_cli_refuse_text_parameters_like_the_webhook() -> None:
    text = json.dumps(GOOD)
    doc = claim([config(text)])
    assert validate_claim_document(doc, DRIVER) == [
        FieldError(P, "must be a JSON object, got a string")
    ]
    allocation = {
        "devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": "n", "device": "gpu-0"}],
            "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": text}}],
        }
    }
    with pytest.raises(ConfigError) as info:
        resolve_configs(allocation, DRIVER)
    assert info.value.errors == [
        FieldError(
            "status.allocation.devices.config[0].opaque.parameters",
            "must be a JSON object, got a string",
        )
    ]


# --- YAML aliases -----------------------------------------------------------------------


def test_alias_bomb_in_a_file_is_refused_at_load() -> None:
    began = time.thread_time()
    with pytest.raises(LoadError) as info:
        load_yaml_documents(alias_bomb(60))
    assert time.thread_time() - began < CPU_BUDGET
    assert str(info.value) == (
        f"invalid YAML: aliases expand the document by more than {MAX_ALIAS_EXPANSION} nodes"
    )


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: *a}\n", "&a [x, *a]\n"])
def test_recursive_alias_is_refused_at_load(text: str) -> None:
    with pytest.raises(LoadError, match=r"^invalid YAML: recursive alias at line 1, column"):
        load_yaml_documents(text)


def test_moderate_alias_use_still_loads() -> None:
    (doc,) = load_yaml_documents(
        "base: &b {strategy: TimeSlicing, timeSlicingConfig: {interval: Long}}\n"
        + "".join(f"c{i}: {{<<: *b}}\n" for i in range(100))
        + "l: &l [1, 2, 3]\nm: [*l, *l, *l]\n"
    )
    assert doc["c99"]["timeSlicingConfig"] == {"interval": "Long"}
    assert doc["m"] == [[1, 2, 3]] * 3


def test_text_given_to_the_decoder_cannot_carry_a_bomb() -> None:
    """`gpu_config_errors` still reads JSON/YAML text (for files): the load refuses the
    bomb before any walk."""
    config, errors = gpu_config_errors(alias_bomb(60), P)
    assert config is None
    assert errors == [
        FieldError(
            P, f"invalid YAML: aliases expand the document by more than {MAX_ALIAS_EXPANSION} nodes"
        )
    ]


def _shared(depth: int, leaf: object) -> list[Any]:
    node: list[Any] = [leaf, leaf]
    for _ in range(depth):
        node = [node, node]
    return node


def test_raw_problem_walk_visits_shared_values_once() -> None:
    duplicate = KeyTrackingDict()
    duplicate["a"] = 1
    duplicate.duplicates.append("a")
    value = {"x": _shared(60, duplicate)}  # 2**61 paths to the one dict
    began = time.thread_time()
    problems = find_raw_problems(value, "p")
    assert time.thread_time() - began < CPU_BUDGET
    assert problems == [FieldError("p.x[0][0]" + "[0]" * 59 + ".a", "duplicate field")]


def test_config_of_shared_values_is_decoded_in_linear_time() -> None:
    began = time.thread_time()
    config, errors = gpu_config_errors({**GOOD, "x": _shared(60, {"k": 1})}, P)
    assert time.thread_time() - began < CPU_BUDGET
    assert config is None and errors == [FieldError(f"{P}.x", "unknown field")]


def test_config_with_thousands_of_fields_is_refused_as_a_whole() -> None:
    fields = {f"field{i}": i for i in range(5000)}
    config, errors = gpu_config_errors({**GOOD, **fields}, P)
    assert config is None
    assert errors == [FieldError(P, f"too large: more than {MAX_CONFIG_VALUES} values")]


def test_deny_message_names_at_most_the_first_errors() -> None:
    bad = {"apiVersion": API_VERSION, "kind": KIND, "sharing": {"strategy": "Nope"}}
    count = MAX_REPORTED_ERRORS + 7
    obj = claim([config(bad) for _ in range(count)])
    message = review(admission(obj, "resourceclaims"), DRIVER)["response"]["status"]["message"]
    assert message.startswith(f"{count} configs failed to validate: ")
    assert message.count("unknown GPU sharing strategy") == MAX_REPORTED_ERRORS
    assert message.endswith("; and 7 more")


# --- the server's bounds ------------------------------------------------------------------


def test_default_bounds() -> None:
    assert LIMITS.timeout <= 10  # the API server's default webhook timeout
    assert LIMITS.max_connections <= 128 and LIMITS.workers <= 4
    assert LIMITS.max_body == 3 * 1024 * 1024
    assert LIMITS.max_buffered <= 64 * 1024 * 1024


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    cert, key = make_cert(tmp_path)
    servers: list[WebhookServer] = []

    def _start(**bounds: Any) -> Served:
        limits = dataclasses.replace(LIMITS, **bounds)
        server = WebhookServer(
            "127.0.0.1", 0, cert_file=cert, key_file=key, driver_name=DRIVER, limits=limits
        )
        server.start()
        servers.append(server)
        return Served(server, cert)

    yield _start
    for server in servers:
        server.shutdown()


def tls(served: Served) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=served.cafile)
    raw = socket.create_connection(("127.0.0.1", served.server.port), timeout=5)
    return context.wrap_socket(raw, server_hostname="localhost")


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def post_head(length: int) -> bytes:
    return (
        f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def legit(served: Served) -> None:
    """A review is admitted, within the client's 10 s, by a server whose connections
    time out after 30 s: with none timed out, whatever it had to make room for it
    was closed at once."""
    assert served.admit(admission(claim([config(GOOD)]), "resourceclaims"))["allowed"] is True
    assert served.server.stats.timed_out == 0


def test_a_dribbling_client_gets_no_more_than_the_request_deadline(
    start: Callable[..., Served],
) -> None:
    """One byte every 0.1 s, never idle for the 0.6 s deadline: closed part way
    through the 20 s the whole request takes to dribble (bytes counted, not seconds)."""
    served = start(timeout=0.6)
    sock = tls(served)
    request = post_head(100) + b"{" * 100
    sent = 0
    with contextlib.suppress(OSError):  # closed by the server
        for byte in request:
            sock.send(bytes([byte]))
            sent += 1
            time.sleep(0.1)
    assert sent < len(request), "the dribbling client was never closed"
    assert served.server.stats.timed_out == 1
    sock.close()


def test_idle_connections_beyond_the_limit_make_room_for_a_review(
    start: Callable[..., Served],
) -> None:
    served = start(max_connections=4, timeout=30)
    idle = [socket.create_connection(("127.0.0.1", served.server.port)) for _ in range(10)]
    try:
        legit(served)
        assert served.server.open_connections <= 4
        assert served.server.stats.evicted >= 6
    finally:
        for sock in idle:
            sock.close()


def test_large_bodies_beyond_the_byte_budget_are_answered_busy_at_once(
    start: Callable[..., Served],
) -> None:
    """Two stalled uploads of announced 3 MiB bodies with a 4 MiB budget: the first
    is read (until its deadline), the second answered 503 at once; a review of the
    usual size needs no budget and is answered."""
    served = start(max_buffered=4 << 20, timeout=30)
    first, second = tls(served), tls(served)
    try:
        first.sendall(post_head(3 << 20) + b" " * (600 << 10))
        deadline = time.monotonic() + EVENT_WAIT
        while served.server.buffered_bytes < 3 << 20:  # the first one's reservation
            assert time.monotonic() < deadline, "the first upload was not read"
            time.sleep(0.01)
        with contextlib.suppress(OSError):  # closed once answered
            second.sendall(post_head(3 << 20) + b" " * (600 << 10))
        second.settimeout(5)
        assert second.recv(1024).startswith(b"HTTP/1.1 503 ")
        assert served.server.stats.busy == 1
        legit(served)
        assert not closed_within(first, 0.1)  # still within its deadline
    finally:
        first.close()
        second.close()


def test_oversized_body_is_refused_before_it_is_read(start: Callable[..., Served]) -> None:
    served = start()
    sock = tls(served)
    try:
        sock.sendall(post_head(LIMITS.max_body + 1))
        sock.settimeout(5)
        assert sock.recv(1024).startswith(b"HTTP/1.1 413 ")
    finally:
        sock.close()
