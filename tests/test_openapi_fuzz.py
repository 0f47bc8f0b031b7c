"""The OpenAPI schema tells the truth: schemathesis generates requests from it, valid and not,
against a live server, and every answer must be one the schema documents (status, media type,
body, each event of a stream) and none a server error. The tutor routes are also walked
statefully along the schema's links: a new session's id into its reads and turns.

The server runs the tiny model with a short context, so that a generated request asking for as
many tokens as fit stays cheap. Examples are bounded and derandomized: the file runs in well under
a minute on two cores and fails the same way twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from conftest import LiveServer, start_server

# What the schema promises about each answer, and that what it forbids is refused. Not
# `positive_data_acceptance`: what depends on the model or the server's state (the context
# length, the vocabulary, a course's name, whether LoRA is on) and the values the server refuses
# on purpose (n != 1, penalties) are no schema types; they are documented 4xx answers instead.
CHECKS = {
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def fuzz_server(synth_llama: str) -> Iterator[LiveServer]:
    server = start_server(synth_llama, "--max-model-len", "64")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def openapi(fuzz_server: LiveServer) -> dict[str, Any]:
    return httpx.get(fuzz_server.url + "/openapi.json").json()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer) -> schemathesis.BaseSchema:
    courses = [c["id"] for c in httpx.get(fuzz_server.url + "/v1/tutor/courses").json()["data"]]
    config = schemathesis.Config.from_dict(
        {
            "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
            # Random strings never name the model or a course, so every request would stop at
            # the 404 or 400 for an unknown one; often enough, the bodies name real ones.
            "dictionaries": {
                "model": {"values": [fuzz_server.model]},
                "course": {"values": courses},
            },
            "parameters": {
                "body.model": {"dictionary": "model", "probability": 0.7},
                "body.course": {"dictionary": "course", "probability": 0.7},
            },
        }
    )
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config)


def test_every_error_is_documented_as_the_openai_error_body(openapi: dict[str, Any]) -> None:
    error_body = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, f"{method} {path}: validation errors are 400s"
            errors = [r for status, r in responses.items() if int(status) >= 400]
            assert errors or path in {"/metrics"}, f"{method} {path} documents no error"
            for r in errors:
                assert r["content"] == {"application/json": {"schema": error_body}}
    # pydantic's names for bounds it could not write as JSON Schema (see protocol.JsonInt).
    text = json.dumps(openapi)
    assert not any(f'"{key}":' in text for key in ("ge", "gt", "le", "lt")), "a bound is lost"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation(api_schema: schemathesis.BaseSchema, mode: GenerationMode) -> None:
    # One hypothesis run per operation (schemathesis's own pytest plugin cannot take a schema
    # from a fixture under pytest 9); a failure names the operation and the curl that repeats it.
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # any string is a valid path segment: only bodies can be invalid

        @given(case=operation.as_strategy(mode))
        @FUZZ
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate()

        check()


def test_tutor_sessions_along_their_links(api_schema: schemathesis.BaseSchema) -> None:
    machine = api_schema.include(path_regex="^/v1/tutor/").as_state_machine()
    # A step sequence is no single test case, so hypothesis's per-case health checks don't fit.
    steps = settings(
        FUZZ, max_examples=30, stateful_step_count=8, suppress_health_check=list(HealthCheck)
    )
    machine.run(settings=steps)
