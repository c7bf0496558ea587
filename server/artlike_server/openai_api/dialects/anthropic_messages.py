"""Anthropic's Messages API (`POST /v1/messages`) as a chat completion, and the answer back.

The `anthropic` SDK's `base_url` is the server root, so a trajectory's is `{server}/t/{id}` (the SDK adds
`/v1/messages`); it sends the key as `x-api-key`, which the API key middleware accepts.

Request -> chat completions body
- `system` (a string or text blocks) -> a leading system message; `messages` (user/assistant, content a
  string or blocks): `text`; `image` (base64 or url source) -> `image_url`; assistant `tool_use` -> the
  assistant message's `tool_calls` (arguments = the JSON of `input`); user `tool_result` (string or text
  blocks; `is_error` prefixes "Error: ") -> `tool` messages, before the rest of that user message;
  `thinking` / `redacted_thinking` blocks in history are dropped (the engine renders no reasoning input).
- `max_tokens` (required, as in Anthropic's API), `temperature`, `top_p`, `top_k`, `stop_sequences` -> `stop`;
  `tools` (name / description / input_schema) -> function tools (strict unless `strict: false`: vLLM
  then constrains the arguments to the schema); `tool_choice` auto / any (-> required) /
  tool (-> a named function) / none, `disable_parallel_tool_use` -> `parallel_tool_calls: false`;
  `output_config.format` (JSON schema) -> `response_format`; `metadata`, `service_tier`, `cache_control` and
  `output_config.effort` are accepted and ignored. (Recent `anthropic` SDKs do not take sampling
  parameters as arguments: send them with `extra_body={"temperature": ...}`.)
- Not supported, 400 naming the field: `thinking` enabled, server tools (`web_search_...`, any typed tool
  other than `custom`), `document` / `search_result` / `container_upload` blocks, `mcp_servers`, `container`.

Chat answer -> message
- Text -> a `text` block; each tool call -> a `tool_use` block (`id` = the chat tool call id, `input` = its
  parsed arguments; arguments that are not a JSON object stay text: a `text` block with the raw arguments).
- `stop_reason`: `end_turn`, `max_tokens`, `tool_use`, or `stop_sequence` with `stop_sequence` set (vLLM's
  choice names the stop string that matched). Usage: `input_tokens`, `output_tokens`, cache reads.
- Streams: `message_start`, per block `content_block_start` / `content_block_delta` (`text_delta`,
  `input_json_delta`) / `content_block_stop`, then `message_delta` (stop reason, output tokens) and
  `message_stop`; errors are `event: error`. Input tokens are known from the first chunk (vLLM's
  `continuous_usage_stats`), so `message_start` carries them as Anthropic's does.

Errors are Anthropic-shaped: `{"type": "error", "error": {"type", "message"}}` with the same status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from artlike_server.errors import APIError
from artlike_server.openai_api.dialects._fields import bad, expect, sse_event

_UNSUPPORTED_FIELDS = ("mcp_servers", "container")
_IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_SAMPLING = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}




# ---------------------------------------------------------------------------------------------- request


def _text_of(blocks: Any, param: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    expect(blocks, list, param, "a string or a list of text blocks")
    texts = []
    for index, block in enumerate(blocks):
        where = f"{param}.{index}"
        expect(block, dict, where, "an object")
        if block.get("type") != "text":
            raise bad(f"{where}.type", f"{block.get('type')!r} is not supported here (text blocks only)",
                       "unsupported_value")
        texts.append(expect(block.get("text"), str, f"{where}.text", "a string"))
    return "\n".join(texts) if param == "system" else "".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = expect(block.get("source"), dict, f"{where}.source", "an object")
    if source.get("type") == "base64":
        media = expect(source.get("media_type"), str, f"{where}.source.media_type", "a string")
        data = expect(source.get("data"), str, f"{where}.source.data", "a base64 string")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": expect(source.get("url"), str, f"{where}.source.url",
                                                                   "a string")}}
    raise bad(f"{where}.source.type", f"{source.get('type')!r} is not supported (base64 or url)", "unsupported_value")


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """One user message's blocks: its tool results as `tool` messages first, then the rest as a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    expect(content, list, where, "a string or a list of content blocks")
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.{index}"
        expect(block, dict, at, "an object")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": expect(block.get("text"), str, f"{at}.text", "a string")})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            tool_use_id = expect(block.get("tool_use_id"), str, f"{at}.tool_use_id", "a string")
            result = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            tool_messages.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        else:
            raise bad(f"{at}.type", f"content block type {kind!r} is not supported in a user message",
                       "unsupported_value")
    messages = tool_messages
    if parts:
        only_text = all(part["type"] == "text" for part in parts)
        messages.append({"role": "user",
                         "content": "".join(part["text"] for part in parts) if only_text else parts})
    return messages


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    expect(content, list, where, "a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.{index}"
        expect(block, dict, at, "an object")
        kind = block.get("type")
        if kind == "text":
            texts.append(expect(block.get("text"), str, f"{at}.text", "a string"))
        elif kind == "tool_use":
            arguments = expect(block.get("input"), dict, f"{at}.input", "an object")
            calls.append({
                "id": expect(block.get("id"), str, f"{at}.id", "a string"),
                "type": "function",
                "function": {"name": expect(block.get("name"), str, f"{at}.name", "a string"),
                             "arguments": json.dumps(arguments, ensure_ascii=False)},
            })
        elif kind in _IGNORED_BLOCKS:
            continue
        else:
            raise bad(f"{at}.type", f"content block type {kind!r} is not supported in an assistant message",
                       "unsupported_value")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]]:
    expect(tools, list, "tools", "a list")
    result = []
    for index, tool in enumerate(tools):
        where = f"tools.{index}"
        expect(tool, dict, where, "an object")
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{where}.type", f"server tool {tool.get('type')!r} is not supported by this server (only "
                       "client tools: name, description, input_schema)", "unsupported_value")
        function: dict[str, Any] = {
            "name": expect(tool.get("name"), str, f"{where}.name", "a string"),
            "parameters": expect(tool.get("input_schema"), dict, f"{where}.input_schema", "a JSON schema object"),
        }
        if tool.get("description") is not None:
            function["description"] = expect(tool["description"], str, f"{where}.description", "a string")
        # Constrained to the schema unless the tool says `strict: false`: a call is then always well-formed
        # (without it the 135M model's forced calls were free JSON, often cut off by max_tokens).
        function["strict"] = tool.get("strict") is not False
        result.append({"type": "function", "function": function})
    return result


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    expect(choice, dict, "tool_choice", "an object")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        name = expect(choice.get("name"), str, "tool_choice.name", "a string")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise bad("tool_choice.type", "must be one of auto, any, tool, none")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body for a Messages request; raises `InvalidRequest` naming the field.

    >>> chat_body({"model": "m", "max_tokens": 5, "system": "Be brief.",
    ...            "messages": [{"role": "user", "content": "hi"}]})["messages"]
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required (a string)", "missing_required_parameter")
    if "max_tokens" not in body:
        raise bad("max_tokens", "is required", "missing_required_parameter")
    max_tokens = expect(body["max_tokens"], int, "max_tokens", "an integer")
    if max_tokens < 1:
        raise bad("max_tokens", "must be at least 1")
    for name in _UNSUPPORTED_FIELDS:
        if body.get(name):
            raise bad(name, "is not supported by this server", "unsupported_parameter")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise bad("thinking", "extended thinking is not supported by this server", "unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list", "missing_required_parameter" if raw is None else "invalid_value")
    for index, message in enumerate(raw):
        where = f"messages.{index}"
        expect(message, dict, where, "an object")
        role = message.get("role")
        if "content" not in message:
            raise bad(f"{where}.content", "is required", "missing_required_parameter")
        if role == "user":
            messages += _user_messages(message["content"], f"{where}.content")
        elif role == "assistant":
            messages.append(_assistant_message(message["content"], f"{where}.content"))
        else:
            raise bad(f"{where}.role", f"must be 'user' or 'assistant', not {role!r}")
    chat: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    for key, (low, high) in _SAMPLING.items():
        if body.get(key) is not None:
            value = expect(body[key], (int, float), key, "a number")
            if not low <= value <= high:
                raise bad(key, f"must be between {low:g} and {high:g}")
            chat[key] = value
    if body.get("top_k") is not None:
        chat["top_k"] = expect(body["top_k"], int, "top_k", "an integer")
    if body.get("stop_sequences") is not None:
        stops = expect(body["stop_sequences"], list, "stop_sequences", "a list of strings")
        chat["stop"] = [expect(stop, str, f"stop_sequences.{i}", "a string") for i, stop in enumerate(stops)]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        if not body.get("tools"):
            raise bad("tool_choice", "needs tools")
        _tool_choice(body["tool_choice"], chat)
    output_format = (body.get("output_config") or {}).get("format")
    if output_format is not None:
        expect(output_format, dict, "output_config.format", "an object")
        if output_format.get("type") != "json_schema":
            raise bad("output_config.format.type", "only 'json_schema' is supported", "unsupported_value")
        schema = expect(output_format.get("schema"), dict, "output_config.format.schema", "a JSON schema object")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if body.get("stream") is not None:
        chat["stream"] = expect(body["stream"], bool, "stream", "a boolean")
        if chat["stream"]:
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


# --------------------------------------------------------------------------------------------- response


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, matched_stop: Any, stops: Sequence[str], *,
                called_tools: bool = False) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a chat choice's finish. A forced (named) call ends
    with finish_reason "stop" in vLLM; Anthropic says "tool_use" whenever the answer ends in tool calls.

    >>> stop_reason("stop", "END", ["END"]), stop_reason("length", None, []), stop_reason("tool_calls", None, [])
    (('stop_sequence', 'END'), ('max_tokens', None), ('tool_use', None))
    >>> stop_reason("stop", None, [], called_tools=True)
    ('tool_use', None)
    """
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or called_tools:
        return "tool_use", None
    if isinstance(matched_stop, str) and matched_stop in stops:
        return "stop_sequence", matched_stop
    return "end_turn", None


def _usage(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _tool_block(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        return {"type": "text", "text": arguments}  # not a call Anthropic's shape can carry: keep the text
    return {"type": "tool_use", "id": call.get("id") or _new_id("toolu"), "name": function.get("name", ""),
            "input": parsed}


@dataclass
class MessagesTranslation:
    """One Messages request: its chat body, and the message built from the chat answer."""

    chat: dict[str, Any]
    stops: list[str]
    message_id: str = field(default_factory=lambda: _new_id("msg"))

    @property
    def chat_body(self) -> dict[str, Any]:
        return self.chat

    async def response(self, chat_response: dict[str, Any], served_name: str) -> dict[str, Any]:
        choice = (chat_response.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [_tool_block(call) for call in message.get("tool_calls") or ()]
        reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), self.stops,
                                       called_tools=any(block["type"] == "tool_use" for block in content))
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": served_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(chat_response.get("usage")),
        }

    def stream(self, served_name: str) -> MessagesStreamEncoder:
        return MessagesStreamEncoder(self, served_name)



class MessagesStreamEncoder:
    """Chat completion chunks in, Anthropic stream events out (see the module docstring)."""

    def __init__(self, translation: MessagesTranslation, served_name: str) -> None:
        self._translation = translation
        self._served_name = served_name
        self._started = False
        self._index = -1  # the content block open (or last opened)
        self._open: Literal["text", "tool_use"] | None = None
        self._calls: dict[int, int] = {}  # chat tool call index -> its block index
        self._finish_reason: str | None = None
        self._matched_stop: Any = None
        self._usage: Any = None

    def _start(self, usage: Any) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {"id": self._translation.message_id, "type": "message", "role": "assistant",
                   "model": self._served_name, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**_usage(usage), "output_tokens": 0}}
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _open_block(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self._index += 1
        self._open = block["type"]
        events.append(sse_event("content_block_start", {"type": "content_block_start", "index": self._index,
                                                      "content_block": block}))
        return events

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if "error" in chunk and chunk.get("choices") is None:  # vLLM's in-stream error event
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            return sse_event("error", {"type": "error", "error": {"type": "api_error",
                                                                "message": str(error.get("message", "engine error"))}})
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        events = self._start(chunk.get("usage"))
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open != "text":
                    events += self._open_block({"type": "text", "text": ""})
                events.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                              "delta": {"type": "text_delta",
                                                                        "text": delta["content"]}}))
            for call in delta.get("tool_calls") or ():
                events += self._tool_call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
                self._matched_stop = choice.get("stop_reason")
        return b"".join(events)

    def _tool_call_delta(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        function = call.get("function") or {}
        if call.get("index", 0) not in self._calls:
            events += self._open_block({"type": "tool_use", "id": call.get("id") or _new_id("toolu"),
                                        "name": function.get("name") or "", "input": {}})
            self._calls[call.get("index", 0)] = self._index
        if function.get("arguments"):
            events.append(sse_event("content_block_delta", {
                "type": "content_block_delta", "index": self._calls[call.get("index", 0)],
                "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
        return events

    async def done(self) -> bytes:
        events = self._start(self._usage)
        events += self._close()
        reason, sequence = stop_reason(self._finish_reason, self._matched_stop, self._translation.stops,
                                       called_tools=bool(self._calls))
        usage = _usage(self._usage)
        events.append(sse_event("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": {"output_tokens": usage["output_tokens"]}}))
        events.append(sse_event("message_stop", {"type": "message_stop"}))
        return b"".join(events)

    def error(self, error: APIError) -> bytes:
        return sse_event("error", error_body(error))


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = _ERROR_TYPES.get(error.status_code, "api_error" if error.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class MessagesDialect:
    """`POST /v1/messages`."""

    endpoint: Literal["messages"] = "messages"

    async def translate(self, body: dict[str, Any]) -> MessagesTranslation:
        chat = chat_body(body)
        return MessagesTranslation(chat=chat, stops=list(chat.get("stop") or []))

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error_body(error)
