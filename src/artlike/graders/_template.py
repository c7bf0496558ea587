"""`{{item.x}}` / `{{sample.output_text}}` templates: one substitution pass, plain lookups, no eval.

Examples:
    >>> render("Q: {{ item.q }} A: {{sample.output_text}}", {"output_text": "4"}, {"q": "2+2"})
    'Q: 2+2 A: 4'
    >>> render("{{item.a.b}} {{item.xs[1]}}", {}, {"a": {"b": 1}, "xs": ["p", "q"]})
    '1 q'
    >>> render("{{item.nope}}", {}, {})
    Traceback (most recent call last):
    ...
    artlike.graders._errors.TemplateError: template variable {{item.nope}}: no key 'nope'
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ._errors import TemplateError

_PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_INDEX = re.compile(r"\[(\d+)\]")


def sample_from_text(text: str) -> dict[str, Any]:
    """OpenAI's sample namespace for a raw model output: `output_json` is set when the text is JSON."""
    sample: dict[str, Any] = {"output_text": text}
    with contextlib.suppress(ValueError):
        sample["output_json"] = json.loads(text)
    return sample


def lookup(path: str, sample: Mapping[str, Any], item: Mapping[str, Any]) -> Any:
    """The value at a dotted path such as `item.a.b`, `item.xs[0]` or `sample.output_json.x`."""
    namespace, _, rest = path.partition(".")
    roots: dict[str, Mapping[str, Any]] = {"item": item, "sample": sample}
    if namespace not in roots or not rest:
        raise TemplateError(path, "must be item.<key> or sample.<key>")
    value: Any = roots[namespace]
    for key in _INDEX.sub(r".\1", rest).split("."):
        if isinstance(value, Mapping):
            if key not in value:
                raise TemplateError(path, f"no key {key!r}")
            value = value[key]
        elif isinstance(value, Sequence) and not isinstance(value, str) and key.isdigit():
            if int(key) >= len(value):
                raise TemplateError(path, f"index {key} out of range")
            value = value[int(key)]
        else:
            raise TemplateError(path, f"cannot look up {key!r} in a {type(value).__name__}")
    return value


def _to_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render(template: str, sample: Mapping[str, Any], item: Mapping[str, Any]) -> str:
    """Substitute every `{{namespace.path}}`. A substituted value is never rendered again."""
    return _PLACEHOLDER.sub(lambda m: _to_text(lookup(m.group(1), sample, item)), template)
