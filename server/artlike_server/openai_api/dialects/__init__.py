"""Other APIs served by translation to chat completions: OpenAI's Responses API, Anthropic's Messages API.

Why translate instead of forwarding to vLLM's own `/v1/responses` and `/v1/messages`: recording needs the
prompt's token ids, the sampled token ids and each sampled token's logprob, for every turn, streamed or not.
vLLM 0.32's chat completions route returns all three (`return_token_ids`, `logprobs`); its Responses route
returns token ids only with `enable_response_messages` (not when streaming) and logprobs only for output
text (none for function calls), and its Messages route has neither (it is itself a translation to chat
completions inside vLLM). One translated path also gives one recording, lease and error path for every API.

A `Dialect` turns a caller's request into a `Translation`: the chat completions body to run, and the way
back (a whole response, or stream chunks as they come). Translations are pure functions of the bodies,
apart from state a dialect keeps itself (the Responses API's stored conversations).
"""

from __future__ import annotations

from typing import Any, Protocol

from artlike_server.errors import APIError
from artlike_server.openai_api.protocol import RecordedEndpoint


class StreamEncoder(Protocol):
    """Turns one streamed chat completion into the dialect's server-sent events."""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events for one chat completion chunk (already rewritten for the caller); b"" for none."""
        ...

    async def done(self) -> bytes:
        """The closing events, sent once the completion is complete (and recorded)."""
        ...

    def error(self, error: APIError) -> bytes:
        """An error event in the dialect's shape, ending the stream."""
        ...


class Translation(Protocol):
    """One request in a dialect, as a chat completions body and the way back."""

    @property
    def chat_body(self) -> dict[str, Any]:
        """The chat completions request to run (`model` as the caller named it)."""
        ...

    async def response(self, chat_response: dict[str, Any], served_name: str) -> dict[str, Any]:
        """The dialect's response for a whole chat completion (already rewritten for the caller)."""
        ...

    def stream(self, served_name: str) -> StreamEncoder:
        """An encoder for the streamed answer."""
        ...


class Dialect(Protocol):
    """An API served through chat completions."""

    @property
    def endpoint(self) -> RecordedEndpoint:
        """The name recorded completions carry (`RecordedCompletion.endpoint`)."""
        ...

    async def translate(self, body: dict[str, Any]) -> Translation:
        """The translation of a request body; raise `InvalidRequest` naming the caller's parameter."""
        ...

    def error_body(self, error: APIError) -> dict[str, Any]:
        """An error response body in the dialect's shape (the SDKs of other APIs parse their own)."""
        ...
