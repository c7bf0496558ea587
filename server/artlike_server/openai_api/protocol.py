"""Schemas of the OpenAI surface: minimal request validation and the small response bodies we build.

The proxy does not re-validate what vLLM validates. A request model here checks only what the proxy itself
relies on (the JSON types and ranges of `model`, `messages`/`prompt`, `stream`, `n`, token limits, sampling
and logprob parameters) so that a bad value becomes a 400 that names the parameter before anything reaches
the engine. Every other field passes through untouched (`extra="allow"`): vLLM's own extensions keep working.
Validation is strict (no "2" -> 2 coercion): the body forwarded is the caller's JSON, not a re-dump of the
model, so coercing here would hide a value vLLM then rejects or reads differently.

Responses are never validated: they are vLLM's JSON, rewritten in place by `serving` (see its docstring).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from artlike_server.errors import InvalidRequest

Endpoint = Literal["chat.completions", "completions"]
"""The engine routes the proxy forwards to."""

RecordedEndpoint = Literal["chat.completions", "completions", "responses", "messages"]
"""The route a recorded completion came through: an engine route, or a dialect translated to chat completions."""

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The roles of the OpenAI chat API's messages."""

PART_TYPES: dict[str, frozenset[str]] = {
    "user": frozenset({"text", "image_url", "input_audio", "file", "audio_url", "video_url", "image_embeds"}),
    "assistant": frozenset({"text", "refusal"}),
}
"""Content part types per role (the OpenAI spec's, plus vLLM's multimodal extensions for user messages);
system, developer and tool messages take text parts only."""

PART_FIELD_TYPES: dict[str, type] = {"text": str, "refusal": str, "image_url": dict, "input_audio": dict,
                                     "file": dict}
"""The field each part type must carry, named like the type, and its JSON type; vLLM's extensions
(`audio_url`, ...) are checked for presence only."""

MAX_CHOICES = 128
"""Upper bound on `n`: each choice is a sequence the engine generates and the log stores."""

ModelId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
"""A served model id as a caller sends it: the base model id (may contain '/'), `name` or `name@N`.

Only shape is checked here; the model manager resolves it against the registry and never builds paths
from it, so nothing a caller sends reaches the filesystem.
"""


class _ForwardedRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: ModelId
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    return_token_ids: bool | None = None
    return_prompt_text: bool | None = None
    use_beam_search: bool | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _ForwardedRequest:
        if self.stream_options is not None and not self.stream:
            raise _ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_ForwardedRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=-1)
    logprob_token_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    include_reasoning: bool | None = None

    @model_validator(mode="after")
    def _roles_are_known(self) -> ChatCompletionRequest:
        # vLLM renders any role into the chat template: an unknown one would be trained as if it were real.
        for index, message in enumerate(self.messages):
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise _ParamError(f"messages[{index}].role", f"messages[{index}].role must be one of "
                                  f"{', '.join(sorted(CHAT_ROLES))}, not {role!r}")
        return self

    @model_validator(mode="after")
    def _messages_are_well_formed(self) -> ChatCompletionRequest:
        # A malformed tool message or content part otherwise reaches vLLM's template as something else
        # (or a 500 there): name the field instead, as the OpenAI API does.
        for index, message in enumerate(self.messages):
            _check_message(f"messages[{index}]", message)
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        # The proxy forces `logprobs` on for recording; without this check a request the OpenAI API
        # (and vLLM) rejects would silently succeed through a trajectory URL.
        if not self.logprobs:
            if self.top_logprobs is not None and (self.top_logprobs == -1 or self.top_logprobs > 0):
                raise _ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
            if self.logprob_token_ids:
                raise _ParamError("logprob_token_ids", "logprob_token_ids requires logprobs to be true")
        return self


def _check_message(where: str, message: dict[str, Any]) -> None:
    """The OpenAI spec's required fields of one chat message (its role is already known to be valid)."""
    role = message["role"]
    content = message.get("content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise _ParamError(f"{where}.tool_call_id", f"{where}.tool_call_id is required (a string) in a tool message")
    if content is None:
        if role not in ("assistant", "function"):
            raise _ParamError(f"{where}.content", f"{where}.content is required in a {role} message")
    elif isinstance(content, list):
        for part_index, part in enumerate(content):
            _check_part(f"{where}.content[{part_index}]", role, part)
    elif not isinstance(content, str):
        raise _ParamError(f"{where}.content", f"{where}.content must be a string or an array of content parts")
    if role == "assistant" and message.get("tool_calls") is not None:
        _check_tool_calls(f"{where}.tool_calls", message["tool_calls"])


def _check_part(where: str, role: str, part: Any) -> None:
    if not isinstance(part, dict):
        raise _ParamError(where, f"{where} must be an object with a type")
    allowed = PART_TYPES.get(role, frozenset({"text"}))
    kind = part.get("type")
    if kind not in allowed:
        raise _ParamError(f"{where}.type", f"{where}.type must be one of {', '.join(sorted(allowed))} in a "
                          f"{role} message, not {kind!r}")
    value = part.get(kind)
    if value is None or not isinstance(value, PART_FIELD_TYPES.get(kind, object)):
        expected = "a string" if PART_FIELD_TYPES.get(kind) is str else "an object"
        raise _ParamError(f"{where}.{kind}", f"{where}.{kind} is required ({expected}) in a {kind} part")
    if kind == "image_url" and not isinstance(part["image_url"].get("url"), str):
        raise _ParamError(f"{where}.image_url.url", f"{where}.image_url.url is required (a string)")


def _check_tool_calls(where: str, tool_calls: Any) -> None:
    if not isinstance(tool_calls, list):
        raise _ParamError(where, f"{where} must be an array of tool calls")
    for call_index, call in enumerate(tool_calls):
        at = f"{where}[{call_index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _ParamError(f"{at}.function", f"{at}.function is required (an object with name and arguments)")
        if not isinstance(call.get("id"), str):
            raise _ParamError(f"{at}.id", f"{at}.id is required (a string)")
        if call.get("type", "function") != "function":  # spec: required; clients that omit it mean "function"
            raise _ParamError(f"{at}.type", f"{at}.type must be 'function', not {call.get('type')!r}")
        for field in ("name", "arguments"):
            if not isinstance(function.get(field), str):
                raise _ParamError(f"{at}.function.{field}", f"{at}.function.{field} is required (a string; "
                                  "arguments are JSON encoded as a string)")


class CompletionRequest(_ForwardedRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None


class _ParamError(ValueError):
    """A cross-field rule that names the parameter to blame (pydantic would blame the whole body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


REQUEST_MODELS: dict[Endpoint, type[_ForwardedRequest]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
}


def validate_request(endpoint: Endpoint, body: dict[str, Any]) -> _ForwardedRequest:
    """Check the fields the proxy relies on; raise `InvalidRequest` naming the first bad parameter."""
    try:
        return REQUEST_MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None


def invalid_request(exc: ValidationError) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    ctx_error = first.get("ctx", {}).get("error")
    if isinstance(ctx_error, _ParamError):
        return InvalidRequest(ctx_error.message, param=ctx_error.param, code="invalid_value")
    loc = first.get("loc", ())
    # `param` is the top-level field, as the OpenAI API reports it; the full location goes in the message.
    param = str(loc[0]) if loc else None
    where = ".".join(str(part) for part in loc)
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return InvalidRequest(message, param=param, code=code)


# ---------------------------------------------------------------------------------------- /v1/models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "artlike"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
