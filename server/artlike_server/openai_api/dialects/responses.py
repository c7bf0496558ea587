"""OpenAI's Responses API (`POST /v1/responses`) as a chat completion, and the answer back.

Request -> chat completions body
- `instructions` -> a leading system message (not carried over by `previous_response_id`, as OpenAI does).
- `input`: a string (one user message) or items: messages (`role` user/system/developer/assistant, content a
  string or `input_text`/`output_text`/`refusal`/`input_image` parts), `function_call` (-> the assistant's
  `tool_calls`; consecutive calls join one assistant message), `function_call_output` (-> a `tool` message),
  `reasoning` (dropped: the engine renders no reasoning input). Other item types -> 400 naming the item.
- `previous_response_id`: the stored conversation of that response comes first (`ResponseStore`).
- `tools` of type `function` (flat: name/description/parameters/strict, strict by default as in OpenAI's
  Responses API) -> chat tools; other types (web search,
  file search, MCP...) -> 400 `tools[i].type`. `tool_choice` auto/none/required or `{"type": "function",
  "name"}`; `parallel_tool_calls`; `max_output_tokens` -> `max_tokens`; `temperature`, `top_p`, `user`;
  `text.format` json_schema/json_object -> `response_format`; `include: ["message.output_text.logprobs"]` with
  `top_logprobs` -> chat logprobs. `background: true` -> 400 (nothing runs in the background here);
  `reasoning`, `truncation`, `service_tier`, `prompt_cache_key`, `safety_identifier` are accepted and echoed or
  ignored. vLLM's sampling extensions (`top_k`, `min_p`, `ignore_eos`, `stop`, `seed`...) pass through.

Chat answer -> response
- Text -> one `message` output item (`output_text`, logprobs when asked), each tool call -> a `function_call`
  item (`call_id` = the chat tool call id). finish_reason `length` -> status `incomplete`
  (`incomplete_details.reason = "max_output_tokens"`). Usage: `input_tokens`, `output_tokens`, cached tokens.
- Streams: `response.created`, `response.in_progress`, then per item `output_item.added`, `content_part.added`,
  `output_text.delta`... or `function_call_arguments.delta`..., their `.done` events, and `response.completed`
  (or `response.incomplete`); every event has a `sequence_number`. No `[DONE]` (OpenAI sends none).

The response is stored after it is complete (and recorded) when `store` is not false.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from artlike_server.errors import APIError, NotFound
from artlike_server.openai_api.dialects._fields import bad, expect, sse_event
from artlike_server.openai_api.response_store import ResponseStore, StoredResponse

LOGPROBS_INCLUDE = "message.output_text.logprobs"
VLLM_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                        "stop", "ignore_eos", "min_tokens")
"""Fields outside OpenAI's Responses API that vLLM's Responses route takes; passed on to chat as they are."""
_MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
_IGNORED_ITEMS = frozenset({"reasoning"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"




# ---------------------------------------------------------------------------------------------- request


def _content_text(content: Any, param: str, *, role: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or parts (images keep it a parts list)."""
    if isinstance(content, str):
        return content
    expect(content, list, param, "a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        expect(part, dict, where, "an object")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": expect(part.get("text"), str, f"{where}.text", "a string")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": expect(part.get("refusal"), str, f"{where}.refusal", "a string")})
        elif kind == "input_image" and role != "assistant":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{where}.image_url", "must be a URL or data URL string (file_id is not supported)")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}})
        else:
            raise bad(f"{where}.type", f"content part type {kind!r} is not supported here", "unsupported_value")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def input_messages(items: Any, param: str = "input") -> list[dict[str, Any]]:
    """Responses input (a string or items) as chat messages.

    >>> input_messages([{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1",
    ...     "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": "3"}])
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'user', 'content': 'hi'},
     {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'c1', 'type': 'function',
       'function': {'name': 'f', 'arguments': '{}'}}]},
     {'role': 'tool', 'tool_call_id': 'c1', 'content': '3'}]
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    expect(items, list, param, "a string or a list of input items")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{param}[{index}]"
        expect(item, dict, where, "an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad(f"{where}.role", f"must be one of {', '.join(sorted(_MESSAGE_ROLES))}, not {role!r}")
            if "content" not in item:
                raise bad(f"{where}.content", "is required", "missing_required_parameter")
            messages.append({"role": role, "content": _content_text(item["content"], f"{where}.content", role=role)})
        elif kind == "function_call":
            call = {
                "id": expect(item.get("call_id"), str, f"{where}.call_id", "a string"),
                "type": "function",
                "function": {
                    "name": expect(item.get("name"), str, f"{where}.name", "a string"),
                    "arguments": expect(item.get("arguments"), str, f"{where}.arguments", "a JSON string"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), (str, type(None))):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = _content_text(output, f"{where}.output", role="tool")
            messages.append({
                "role": "tool",
                "tool_call_id": expect(item.get("call_id"), str, f"{where}.call_id", "a string"),
                "content": content,
            })
        elif kind in _IGNORED_ITEMS:
            continue
        else:
            raise bad(f"{where}.type", f"input item type {kind!r} is not supported by this server", "unsupported_value")
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    expect(tools, list, "tools", "a list")
    result = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        expect(tool, dict, where, "an object")
        if tool.get("type") != "function":
            raise bad(f"{where}.type", f"tool type {tool.get('type')!r} is not supported by this server (only "
                       "'function' tools)", "unsupported_value")
        function: dict[str, Any] = {"name": expect(tool.get("name"), str, f"{where}.name", "a string")}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        # Strict by default in the Responses API (not in chat completions): vLLM then constrains the arguments
        # to the schema; without it a small model's arguments are free JSON, often cut off by max_tokens.
        function["strict"] = tool.get("strict") is not False
        result.append({"type": "function", "function": function})
    return result


def chat_tool_choice(choice: Any) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", "must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
               "unsupported_value")


def response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    expect(text, dict, "text", "an object")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    expect(fmt, dict, "text.format", "an object")
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad("text.format.type", f"{fmt.get('type')!r} is not supported", "unsupported_value")


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    expect(value, (int, float), key, "a number")
    if not low <= value <= high:
        raise bad(key, f"must be between {low:g} and {high:g}")
    return float(value)


def chat_body(body: dict[str, Any], history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body for a Responses request (`history`: the stored conversation it continues)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required", "missing_required_parameter")
    if "input" not in body and not history:
        raise bad("input", "is required", "missing_required_parameter")
    if body.get("background"):
        raise bad("background", "background responses are not supported by this server", "unsupported_parameter")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": expect(instructions, str, "instructions", "a string")})
    messages += history
    if body.get("input") is not None:
        messages += input_messages(body["input"])
    if not messages:
        raise bad("input", "must not be empty")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = expect(body["parallel_tool_calls"], bool, "parallel_tool_calls", "a boolean")
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("tool_choice", "needs tools")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if expect(max_output_tokens, int, "max_output_tokens", "an integer") < 1:
            raise bad("max_output_tokens", "must be at least 1")
        chat["max_tokens"] = max_output_tokens
    for key, high in (("temperature", 2.0), ("top_p", 1.0)):
        if (value := _number(body, key, 0.0, high)) is not None:
            chat[key] = value
    if isinstance(body.get("user"), str):
        chat["user"] = body["user"]
    for key in VLLM_SAMPLING_EXTRAS:  # vLLM's own sampling extensions, which its Responses route accepts too
        if key in body:
            chat[key] = body[key]
    if (fmt := response_format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    include = body.get("include") or []
    expect(include, list, "include", "a list")
    if LOGPROBS_INCLUDE in include:
        chat["logprobs"] = True
        top = body.get("top_logprobs")
        if top is not None:
            if not 0 <= expect(top, int, "top_logprobs", "an integer") <= 20:
                raise bad("top_logprobs", "must be between 0 and 20")
            chat["top_logprobs"] = top
    if body.get("stream") is not None:
        chat["stream"] = expect(body["stream"], bool, "stream", "a boolean")
        if chat["stream"]:
            chat["stream_options"] = {"include_usage": True}
    return chat


# --------------------------------------------------------------------------------------------- response


def _logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries as Responses `LogProb`s (same fields; `bytes` required, never null)."""
    if not isinstance(chat_logprobs, dict):
        return []
    result = []
    for entry in chat_logprobs.get("content") or ():
        result.append({
            "token": entry["token"],
            "logprob": entry["logprob"],
            "bytes": entry.get("bytes") or list(entry["token"].encode()),
            "top_logprobs": [
                {"token": top["token"], "logprob": top["logprob"], "bytes": top.get("bytes") or list(top["token"].encode())}
                for top in entry.get("top_logprobs") or ()
            ],
        })
    return result


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    }


def _empty_message(item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def assistant_message(output: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the chat assistant message they continue a conversation with."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class ResponsesTranslation:
    """One Responses request: its chat body, and the response built from the chat answer."""

    body: dict[str, Any]
    chat: dict[str, Any]
    conversation: list[dict[str, Any]]  # the messages to store: history + input, without instructions
    store: ResponseStore | None
    response_id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat_body(self) -> dict[str, Any]:
        return self.chat

    def envelope(self, served_name: str, status: str) -> dict[str, Any]:
        """The response object around its output, as OpenAI returns it (echoing the request's settings)."""
        body = self.body
        tool_choice = body.get("tool_choice", "auto")
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": None,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": served_name,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True) is not False,
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": tool_choice,
            # as translated: a function tool's `strict` is required in the schema (and true by default here)
            "tools": [{**tool, "strict": tool.get("strict") is not False} for tool in body.get("tools") or ()],
            "top_logprobs": body.get("top_logprobs", 0),
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation") or "disabled",
            "metadata": body.get("metadata") or {},
            # `usage` comes with the finished response; `user` only when given (the schema has no null for either)
            **({"user": body["user"]} if isinstance(body.get("user"), str) else {}),
        }

    def finish(self, response: dict[str, Any], finish_reason: str | None, usage: Any) -> None:
        """Fill in the final status, usage and time."""
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
            response["completed_at"] = int(time.time())
        if (summary := _usage(usage)) is not None:
            response["usage"] = summary

    async def save(self, response: dict[str, Any]) -> None:
        if self.store is None or self.body.get("store") is False:
            return
        messages = [*self.conversation, assistant_message(response["output"])]
        await self.store.save(StoredResponse(self.response_id, time.time(), messages, response))

    async def response(self, chat_response: dict[str, Any], served_name: str) -> dict[str, Any]:
        response = self.envelope(served_name, "completed")
        choice = (chat_response.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(_new_id("msg"), message.get("content") or "",
                                        _logprobs(choice.get("logprobs")), "completed"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            output.append(_call_item(_new_id("fc"), call.get("id") or _new_id("call"), function.get("name", ""),
                                     function.get("arguments") or "", "completed"))
        response["output"] = output
        self.finish(response, choice.get("finish_reason"), chat_response.get("usage"))
        await self.save(response)
        return response

    def stream(self, served_name: str) -> ResponsesStreamEncoder:
        return ResponsesStreamEncoder(self, served_name)



@dataclass
class _OpenItem:
    output_index: int
    item: dict[str, Any]
    kind: Literal["message", "function_call"]
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponsesStreamEncoder:
    """Chat completion chunks in, Responses API stream events out (see the module docstring)."""

    def __init__(self, translation: ResponsesTranslation, served_name: str) -> None:
        self._translation = translation
        self._response = translation.envelope(served_name, "in_progress")
        self._sequence = 0
        self._started = False
        self._output: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}  # chat tool call index -> its function_call item
        self._finish_reason: str | None = None
        self._usage: Any = None

    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return sse_event(kind, payload)

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [self._emit("response.created", response=self._response),
                self._emit("response.in_progress", response=self._response)]

    def _open_item(self, kind: Literal["message", "function_call"], item: dict[str, Any]) -> tuple[_OpenItem, list[bytes]]:
        events = self._close_open()
        opened = _OpenItem(len(self._output), item, kind)
        self._output.append(item)
        self._open = opened
        events.append(self._emit("response.output_item.added", output_index=opened.output_index, item=dict(item)))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._emit("response.content_part.added", item_id=item["id"],
                                     output_index=opened.output_index, content_index=0, part=part))
        return opened, events

    def _close_open(self) -> list[bytes]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        item, index = opened.item, opened.output_index
        events: list[bytes] = []
        if opened.kind == "message":
            text = "".join(opened.text)
            item.update(_message_item(item["id"], text, opened.logprobs, "completed"))
            events.append(self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text, logprobs=opened.logprobs))
            events.append(self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=item["content"][0]))
        else:
            item["arguments"] = "".join(opened.text)
            item["status"] = "completed"
            events.append(self._emit("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._emit("response.output_item.done", output_index=index, item=item))
        return events

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        events = self._start()
        if "error" in chunk and chunk.get("choices") is None:  # vLLM's in-stream error event
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            events.append(self._emit("error", code=str(error.get("code")) if error.get("code") is not None else None,
                                     message=str(error.get("message", "engine error")), param=error.get("param")))
            return b"".join(events)
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                opened = self._open
                if opened is None or opened.kind != "message":
                    opened, opened_events = self._open_item("message", _empty_message(_new_id("msg")))
                    events += opened_events
                logprobs = _logprobs(choice.get("logprobs"))
                opened.text.append(delta["content"])
                opened.logprobs += logprobs
                events.append(self._emit("response.output_text.delta", item_id=opened.item["id"],
                                         output_index=opened.output_index, content_index=0,
                                         delta=delta["content"], logprobs=logprobs))
            for call in delta.get("tool_calls") or ():
                events += self._tool_call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return b"".join(events)

    def _tool_call_delta(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        opened = self._calls.get(index)
        if opened is None:
            item = _call_item(_new_id("fc"), call.get("id") or _new_id("call"), function.get("name") or "", "",
                              "in_progress")
            opened, opened_events = self._open_item("function_call", item)
            self._calls[index] = opened
            events += opened_events
        elif opened is not self._open:
            raise ValueError("tool call deltas interleaved across calls")  # vLLM streams calls one after another
        if function.get("name") and not opened.item["name"]:
            opened.item["name"] = function["name"]
        if function.get("arguments"):
            opened.text.append(function["arguments"])
            events.append(self._emit("response.function_call_arguments.delta", item_id=opened.item["id"],
                                     output_index=opened.output_index, delta=function["arguments"]))
        return events

    async def done(self) -> bytes:
        events = self._start()
        if not self._output:
            _, opened_events = self._open_item("message", _empty_message(_new_id("msg")))
            events += opened_events
        events += self._close_open()
        response = self._response
        response["output"] = self._output
        self._translation.finish(response, self._finish_reason, self._usage)
        await self._translation.save(response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        events.append(self._emit(kind, response=response))
        return b"".join(events)

    def error(self, error: APIError) -> bytes:
        events = self._start()
        events.append(self._emit("error", code=error.code, message=error.message, param=error.param))
        return b"".join(events)


class ResponsesDialect:
    """`POST /v1/responses`, with the store that `previous_response_id` reads."""

    endpoint: Literal["responses"] = "responses"

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    async def translate(self, body: dict[str, Any]) -> ResponsesTranslation:
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            expect(previous, str, "previous_response_id", "a string")
            stored = await self.store.get(previous) if self.store is not None else None
            if stored is None:
                raise NotFound(f"no stored response {previous!r} (was it created with store: false, or pruned?)",
                               param="previous_response_id", code="previous_response_not_found")
            history = stored.messages
        chat = chat_body(body, history)
        has_instructions = body.get("instructions") is not None
        conversation = chat["messages"][1:] if has_instructions else list(chat["messages"])
        return ResponsesTranslation(body=body, chat=chat, conversation=conversation, store=self.store)

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error.body()

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}`: a stored response as it was returned."""
        stored = await self.store.get(response_id) if self.store is not None else None
        if stored is None:
            raise NotFound(f"no stored response {response_id!r}", param="response_id", code="response_not_found")
        return stored.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        """`DELETE /v1/responses/{id}`."""
        if self.store is None or not await self.store.delete(response_id):
            raise NotFound(f"no stored response {response_id!r}", param="response_id", code="response_not_found")
        return {"id": response_id, "object": "response", "deleted": True}
