"""score_model, label_model and reward_model: render the judge's messages and read a score or label from its
answer; build the conversation a reward model scores.

The LLM call itself is the caller's `judge(messages, model) -> str`, the reward model's the caller's
`scorer(messages, model) -> float` (sync or async); this module never talks to a network.

    >>> parse_score('{"result": 0.7}', (0.0, 1.0)), parse_score("Score: 8/10", (0.0, 10.0))
    (0.7, 8.0)
    >>> parse_score("1.5", (0.0, 1.0))  # clamped to the range
    1.0
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ._errors import ScoreParseError, TemplateError
from ._template import render
from ._types import JudgeMessage, PythonGrader, RewardModelGrader

Judge = Callable[[list[dict[str, Any]], str], "str | Awaitable[str]"]
"""`judge(messages, model)`: the judge model's text answer to OpenAI-shape chat messages."""

Scorer = Callable[[list[dict[str, Any]], str], "float | Awaitable[float]"]
"""`scorer(messages, model)`: reward model `model`'s combined score of a conversation (OpenAI-shape chat
messages ending with the assistant's answer); raise `ScorerUnavailable` when it cannot be asked."""

PythonRunner = Callable[["PythonGrader", dict[str, Any], Mapping[str, Any]], "float | Awaitable[float]"]
"""`python(grader, sample, item)`: run a python grader's `grade(sample, item)` somewhere safe (the server's
sandbox) and return its score; raise `GradingFailed` for a failure of the user's code."""

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _render_part(part: dict[str, Any], sample: Mapping[str, Any], item: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(part.get("text"), str):  # input_text / output_text parts
        return {**part, "text": render(part["text"], sample, item)}
    return part


def render_messages(
    messages: list[JudgeMessage], sample: Mapping[str, Any], item: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The grader's `input` with every template in its text rendered, as plain dicts."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.content
        rendered: str | dict[str, Any] | list[dict[str, Any]]
        if isinstance(content, str):
            rendered = render(content, sample, item)
        elif isinstance(content, dict):
            rendered = _render_part(content, sample, item)
        else:
            rendered = [_render_part(p, sample, item) for p in content]
        out.append({**message.model_dump(exclude_none=True), "content": rendered})
    return out


def scored_conversation(
    grader: RewardModelGrader, sample: Mapping[str, Any], item: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """What a reward_model grader scores: its prompt (`input` rendered, or the item's `messages` / `prompt`)
    and the sample as the assistant's answer.

    >>> g = RewardModelGrader(model="rm")
    >>> scored_conversation(g, {"output_text": "4"}, {"prompt": "2+2?"})
    [{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]
    """
    if grader.input is not None:
        prompt = render_messages(grader.input, sample, item)
    elif isinstance(item.get("messages"), list):
        prompt = [dict(m) for m in item["messages"] if isinstance(m, Mapping)]
        if len(prompt) != len(item["messages"]):
            raise TemplateError("item.messages", "every message must be an object")
    elif isinstance(item.get("prompt"), str):
        prompt = [{"role": "user", "content": item["prompt"]}]
    else:
        raise TemplateError("item.messages", "the item has no 'messages' (a list) or 'prompt' (a string) to score "
                                             "the answer after: give the reward_model grader an `input`")
    answer: dict[str, Any] = {"role": "assistant", "content": render("{{sample.output_text}}", sample, item)}
    if sample.get("output_tools"):
        answer["tool_calls"] = list(sample["output_tools"])
    return [*prompt, answer]


def _json_field(answer: str, keys: tuple[str, ...]) -> Any:
    try:
        data = json.loads(answer)
    except ValueError:
        return None
    if isinstance(data, dict):
        return next((data[k] for k in keys if k in data), None)
    return data


def parse_score(answer: str, range: tuple[float, float]) -> float:
    """`{"result": x}` (or `{"score": x}`, or a bare JSON number), else the first number in the text;
    clamped to `range`."""
    value = _json_field(answer.strip(), ("result", "score"))
    if isinstance(value, bool) or not isinstance(value, int | float):
        match = _NUMBER.search(answer)
        if match is None:
            raise ScoreParseError(f"no score in the judge's answer {answer[:200]!r}")
        value = float(match.group())
    return min(max(float(value), range[0]), range[1])


def parse_label(answer: str, labels: list[str]) -> str:
    """`{"result": label}` (or `{"label": ...}`), else the answer itself, stripped of quotes and dots."""
    value = _json_field(answer.strip(), ("result", "label"))
    label = value if isinstance(value, str) else answer.strip().strip("\"'.` ")
    for known in labels:
        if label.casefold() == known.casefold():
            return known
    raise ScoreParseError(f"the judge's answer {answer[:200]!r} is none of the labels {labels}")
