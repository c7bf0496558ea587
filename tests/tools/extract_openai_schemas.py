"""Extract the OpenAI response schemas our tests validate against into tests/data/openai_schemas.json.

    python tests/tools/extract_openai_schemas.py ../shared/reference/openai-openapi.yaml

The official spec (openai/openai-openapi, MIT) is 3 MB of YAML; the tests need a few dozen of its
component schemas, so this keeps those reachable from `ROOTS` as one JSON Schema (draft 2020-12) document
with the components under `$defs`. Conversions, so that `jsonschema` reads it as OpenAPI means it:
- `$ref: #/components/schemas/X` → `#/$defs/X`;
- OpenAPI 3.0's `nullable: true` (the spec says 3.1 but still uses it) → the schema also accepts null;
- annotations (`description`, `example`, `title`, `x-*`, `discriminator`, ...) are dropped: they do not
  constrain anything and are most of the size.
Needs pyyaml; the tests read only the JSON this writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

ROOTS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",  # the Responses API's response object
    "ResponseStreamEvent",  # and every event of its stream
    # managed jobs: files, graders, fine-tuning jobs
    "OpenAIFile",
    "ListFilesResponse",
    "DeleteFileResponse",
    "RunGraderResponse",
    "ValidateGraderResponse",
    "FineTuningJob",
    "FineTuningJobEvent",
    "FineTuningJobCheckpoint",
    "ListPaginatedFineTuningJobsResponse",
    "ListFineTuningJobEventsResponse",
    "ListFineTuningJobCheckpointsResponse",
]
OUTPUT = Path(__file__).resolve().parents[1] / "data" / "openai_schemas.json"
REF_PREFIX = "#/components/schemas/"
ANNOTATIONS = frozenset({"description", "example", "examples", "title", "deprecated", "discriminator",
                         "externalDocs", "xml", "readOnly", "writeOnly", "dataDescription"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
"""Keywords whose value maps names to schemas: the names are data, not keywords to drop."""


def convert(schema: Any) -> Any:
    """One schema (or a list of schemas) converted as the module docstring says."""
    if isinstance(schema, list):
        return [convert(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS or key.startswith("x-") or key == "nullable":
            continue
        if key == "$ref":
            out[key] = "#/$defs/" + value.removeprefix(REF_PREFIX)
        elif key in NAMED_SCHEMAS:
            out[key] = {name: convert(sub) for name, sub in value.items()}
        elif key in ("enum", "const", "default", "required"):
            out[key] = value
        else:
            out[key] = convert(value)
    return make_nullable(out) if schema.get("nullable") is True else out


def make_nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "enum" in schema and None not in schema["enum"]:
        schema = {**schema, "enum": [*schema["enum"], None]}
    kind = schema.get("type")
    if isinstance(kind, str):
        return {**schema, "type": [kind, "null"]}
    if isinstance(kind, list):
        return schema if "null" in kind else {**schema, "type": [*kind, "null"]}
    if "enum" in schema:
        return schema
    # A $ref or a composition: nullability has to sit outside it.
    return {"anyOf": [schema, {"type": "null"}]}


def referenced(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_PREFIX):
            found.add(ref.removeprefix(REF_PREFIX))
        for value in schema.values():
            found |= referenced(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= referenced(value)
    return found


def extract(spec: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    components: dict[str, Any] = spec["components"]["schemas"]
    keep: dict[str, Any] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in keep:
            continue
        keep[name] = components[name]
        pending.extend(referenced(components[name]) - keep.keys())
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (f"Extracted from the OpenAI OpenAPI spec {spec['info']['version']} by "
                     "tests/tools/extract_openai_schemas.py (MIT, see openai_schemas.LICENSE)."),
        "$defs": {name: convert(keep[name]) for name in sorted(keep)},
    }


def load_spec(path: Path) -> dict[str, Any]:
    # libyaml's loader when present: the pure-Python one is far slower on the 3 MB spec.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec: dict[str, Any] = yaml.load(path.read_text(), Loader=loader)
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="openai-openapi.yaml")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    document = extract(load_spec(args.spec), ROOTS)
    args.output.write_text(json.dumps(document, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{args.output}: {len(document['$defs'])} schemas, {args.output.stat().st_size} bytes")


if __name__ == "__main__":
    main()
