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
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        # The proxy forces `logprobs` on for recording; without this check a request the OpenAI API
        # (and vLLM) rejects would silently succeed through a trajectory URL.
        if not self.logprobs:
            if self.top_logprobs is not None and (self.top_logprobs == -1 or self.top_logprobs > 0):
                raise _ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
            if self.logprob_token_ids:
                raise _ParamError("logprob_token_ids", "logprob_token_ids requires logprobs to be true")
        return self


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
