"""Dataset rows: parsed and checked once, with errors that name the line and the field.

Reinforcement rows are prompts: MotteRL's `{"prompt": str, "expected_result": ..., ...}` or a chat
`{"messages": [...], "tools"?: [...], ...}` ending in a non-assistant message (SeekrFlow's `reference_answer`
and OpenAI's arbitrary extra fields ride along). Every key of a row reaches the reward: MotteRL's reward gets
them as `**kwargs`, graders as `item.*`. Supervised rows are OpenAI's chat examples; DPO rows OpenAI's
preference format, turned into artlike's `MessagesPair`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class DatasetError(ValueError):
    def __init__(self, message: str, *, line: int | None = None, field: str | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line = line
        self.field = field


@dataclass(frozen=True)
class PromptRow:
    line: int  # 1-based line in the file (or position in an inline list)
    messages: list[dict[str, Any]]  # the chat to send
    tools: list[dict[str, Any]] | None
    item: dict[str, Any]  # the whole row, as given


def _objects(content: bytes | Sequence[Mapping[str, Any]]) -> list[tuple[int, Any]]:
    """(line, parsed row) for each non-blank line of JSONL, or each element of a list."""
    if isinstance(content, bytes | bytearray):
        out = []
        for number, raw in enumerate(bytes(content).splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                out.append((number, orjson.loads(raw)))
            except orjson.JSONDecodeError as error:
                raise DatasetError(f"not valid JSON ({error})", line=number) from error
        rows = out
    else:
        rows = list(enumerate(content, start=1))
    if not rows:
        raise DatasetError("the dataset has no rows")
    for number, row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"a row must be a JSON object, not {type(row).__name__}", line=number)
    return rows


def _check_messages(messages: Any, *, line: int, field: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"'{field}' must be a non-empty list of messages", line=line, field=field)
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        if not isinstance(message, dict):
            raise DatasetError(f"'{where}' must be an object", line=line, field=where)
        role = message.get("role")
        if role not in ROLES:
            raise DatasetError(f"'{where}.role' must be one of {', '.join(sorted(ROLES))}, not {role!r}",
                               line=line, field=f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if isinstance(content, list):
            if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
                raise DatasetError(f"'{where}.content' parts must be objects with text", line=line,
                                   field=f"{where}.content")
        elif not isinstance(content, str):
            raise DatasetError(f"'{where}.content' must be a string or a list of parts", line=line,
                               field=f"{where}.content")
    return messages


def _check_tools(row: Mapping[str, Any], line: int) -> list[dict[str, Any]] | None:
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools):
        raise DatasetError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
                           line=line, field="tools")
    return tools


def parse_prompt_rows(content: bytes | Sequence[Mapping[str, Any]], *, max_rows: int | None = None) -> list[PromptRow]:
    """Reinforcement rows. Raises DatasetError naming the first bad line and field."""
    rows = _objects(content)
    if max_rows is not None and len(rows) > max_rows:
        raise DatasetError(f"the dataset has {len(rows)} rows; at most {max_rows} are accepted")
    parsed = []
    for line, row in rows:
        has_prompt, has_messages = "prompt" in row, "messages" in row
        if has_prompt == has_messages:
            raise DatasetError("a row needs exactly one of 'prompt' (a string) or 'messages' (a chat)",
                               line=line, field="prompt")
        if has_prompt:
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise DatasetError("'prompt' must be a non-empty string", line=line, field="prompt")
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            messages = _check_messages(row["messages"], line=line, field="messages")
            if messages[-1].get("role") == "assistant":
                raise DatasetError("'messages' must end with the message the model answers (user, system or "
                                   "tool), not an assistant message", line=line, field="messages")
        parsed.append(PromptRow(line=line, messages=messages, tools=_check_tools(row, line), item=dict(row)))
    return parsed


def parse_chat_examples(content: bytes | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's supervised rows `{"messages": [...], "tools"?}` with at least one assistant message."""
    examples = []
    for line, row in _objects(content):
        messages = _check_messages(row.get("messages"), line=line, field="messages")
        if not any(m.get("role") == "assistant" for m in messages):
            raise DatasetError("'messages' has no assistant message to learn", line=line, field="messages")
        examples.append({"messages": messages, "tools": _check_tools(row, line)})
    return examples


def parse_preference_rows(content: bytes | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's DPO rows `{"input": {"messages", "tools"?}, "preferred_output": [...],
    "non_preferred_output": [...]}` as artlike's MessagesPair `{"prompt", "chosen", "rejected", "tools"}`."""
    pairs = []
    for line, row in _objects(content):
        given = row.get("input")
        if not isinstance(given, dict):
            raise DatasetError("'input' must be an object with 'messages'", line=line, field="input")
        prompt = _check_messages(given.get("messages"), line=line, field="input.messages")
        chosen = _check_messages(row.get("preferred_output"), line=line, field="preferred_output")
        rejected = _check_messages(row.get("non_preferred_output"), line=line, field="non_preferred_output")
        for field, side in (("preferred_output", chosen), ("non_preferred_output", rejected)):
            if not any(m.get("role") == "assistant" for m in side):
                raise DatasetError(f"'{field}' has no assistant message", line=line, field=field)
        if chosen == rejected:
            raise DatasetError("'preferred_output' and 'non_preferred_output' are the same", line=line,
                               field="non_preferred_output")
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                      "tools": _check_tools(given, line)})
    return pairs
