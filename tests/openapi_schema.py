"""Validate a response body against a component schema of the official OpenAI OpenAPI spec.

The schemas come from tests/data/openai_schemas.json, extracted from the spec by
tests/tools/extract_openai_schemas.py (nullable already converted), so no YAML is read here.

    assert_valid("CreateChatCompletionResponse", response.json())
    assert_valid("ResponseStreamEvent", event)   # an anyOf of events: checked against the one its `type` names
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource

SCHEMAS_PATH = Path(__file__).resolve().parent / "data" / "openai_schemas.json"
DOCUMENT_URI = "urn:openai-openapi"


@functools.cache
def _document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(SCHEMAS_PATH.read_text())
    return document


@functools.cache
def _validator(component: str) -> Draft202012Validator:
    document = _document()
    if component not in document["$defs"]:
        raise KeyError(f"{component} is not in {SCHEMAS_PATH.name}; add it to ROOTS in the extractor")
    registry: Registry[Any] = Registry().with_resource(DOCUMENT_URI, Resource.from_contents(document))
    return Draft202012Validator({"$ref": f"{DOCUMENT_URI}#/$defs/{component}"}, registry=registry)


def component_names() -> list[str]:
    return sorted(_document()["$defs"])


def _narrowed(component: str, payload: Any) -> str:
    """For a union of typed objects (e.g. ResponseStreamEvent), the member whose `type` the payload names:
    an error then says which field of that member is wrong instead of "matches none of 60 schemas"."""
    schema = _document()["$defs"][component]
    members = schema.get("anyOf") or schema.get("oneOf")
    if not members or not isinstance(payload, dict) or "type" not in payload:
        return component
    for member in members:
        name = member.get("$ref", "").removeprefix("#/$defs/")
        allowed = _document()["$defs"].get(name, {}).get("properties", {}).get("type", {}).get("enum", [])
        if payload["type"] in allowed:
            return name
    return component


def schema_errors(component: str, payload: Any) -> list[str]:
    """Every violation, as `path: message` lines (empty when the payload is valid)."""
    target = _narrowed(component, payload)
    errors = sorted(_validator(target).iter_errors(payload), key=lambda error: list(error.absolute_path))
    return [_describe(target, error) for error in errors]


def _describe(target: str, error: ValidationError) -> str:
    # "is not valid under any of the given schemas" says nothing: name the union member's own error
    # (the deepest one, e.g. a missing required field) instead, skipping the "or null" branches.
    while error.context:
        informative = [e for e in error.context if not (e.validator == "type" and e.validator_value == "null")]
        error = best_match(informative or error.context)
    path = "/".join(str(part) for part in error.absolute_path) or "(root)"
    return f"{target} at {path}: {error.message[:300]}"


def assert_valid(component: str, payload: Any) -> None:
    errors = schema_errors(component, payload)
    assert not errors, "\n".join(errors) + f"\npayload: {json.dumps(payload)[:2000]}"
