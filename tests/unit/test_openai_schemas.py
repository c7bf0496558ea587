"""The extracted OpenAI schemas (tests/data/openai_schemas.json) and the validation helper the shape tests use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.openapi_schema import SCHEMAS_PATH, component_names, schema_errors

extractor = pytest.importorskip("tests.tools.extract_openai_schemas", reason="the extractor needs pyyaml")
ROOTS, convert, extract = extractor.ROOTS, extractor.convert, extractor.extract


REPO = Path(__file__).resolve().parents[2]
SPEC_CANDIDATES = [REPO.parent / "shared/reference/openai-openapi.yaml",
                   REPO.parents[1] / "shared/reference/openai-openapi.yaml"]

CHAT = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": "hi", "refusal": None}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def test_nullable_becomes_json_schema_nullability() -> None:
    assert convert({"type": "string", "nullable": True, "description": "d"}) == {"type": ["string", "null"]}
    assert convert({"type": "string", "enum": ["a"], "nullable": True}) == {"type": ["string", "null"],
                                                                            "enum": ["a", None]}
    assert convert({"$ref": "#/components/schemas/X", "nullable": True}) == {
        "anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}]}
    # A property named like an annotation is data, not an annotation.
    assert convert({"properties": {"description": {"type": "string", "x-foo": 1}}}) == {
        "properties": {"description": {"type": "string"}}}


def test_every_root_is_extracted() -> None:
    assert set(ROOTS) <= set(component_names())


def test_the_helper_accepts_a_valid_body_and_names_what_is_wrong() -> None:
    assert schema_errors("CreateChatCompletionResponse", CHAT) == []
    bad: dict[str, Any] = json.loads(json.dumps(CHAT))
    bad["choices"][0]["message"]["annotations"] = None
    del bad["usage"]["total_tokens"]
    errors = schema_errors("CreateChatCompletionResponse", bad)
    assert any("choices/0/message/annotations" in error for error in errors), errors
    assert any("'total_tokens' is a required property" in error for error in errors), errors


def test_a_stream_event_is_checked_against_the_event_its_type_names() -> None:
    [error, *_] = schema_errors("ResponseStreamEvent", {"type": "response.output_text.delta", "delta": "x"})
    assert error.startswith("ResponseTextDeltaEvent")


def test_the_committed_json_is_what_the_extractor_makes_from_the_spec() -> None:
    pytest.importorskip("yaml")
    from tests.tools.extract_openai_schemas import load_spec
    spec = next((path for path in SPEC_CANDIDATES if path.is_file()), None)
    if spec is None:
        pytest.skip("the OpenAPI spec (../shared/reference) is not on this machine")
    assert extract(load_spec(spec), ROOTS) == json.loads(SCHEMAS_PATH.read_text())
