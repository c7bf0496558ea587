"""Scoring conversations with a reward model from the client: `art.score(...)` and `model.score(...)` over
`POST /v1/rewards`.

An input is a recorded `Trajectory` (sent as `{"trajectory_id"}`: the server scores its last recorded
completion with its prompt, token-exact), an offline one (its messages and tools, rendered with the served
chat template), a list of chat messages ending with the assistant's answer, or a dict in the wire's shapes
(`{"messages", "tools"?}`, `{"trajectory_id"?, "completion_id"?}`).

More inputs than one request takes (`MAX_INPUTS`) go in several requests, all scored by the step the first
one resolved (`name@N`), so one call never mixes two steps of the reward model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from ._http import DEFAULT_TIMEOUT, Connection, RetryPolicy
from ._trajectory import Trajectory
from .types import MessagesInput, RecordedInput, RewardScore, RewardsRequest, RewardsResponse

if TYPE_CHECKING:
    from ._model import TrainableModel  # which calls score_with: imported for the annotations only

__all__ = ["ScoreInput", "score", "score_sync"]

ScoreInput = Trajectory | Sequence[Mapping[str, Any]] | Mapping[str, Any]
"""A recorded or offline `Trajectory`, a list of chat messages, or a wire input as a dict."""

MAX_INPUTS = 1024  # RewardsRequest.inputs' limit


def to_reward_input(item: ScoreInput) -> RecordedInput | MessagesInput | list[dict[str, Any]]:
    """The wire form of one input; raises ValueError for a failed trajectory or a shape the server refuses."""
    if isinstance(item, Trajectory):
        if item.failed:
            raise ValueError(f"{item!r} failed and cannot be scored")
        if item.recorded:
            if item.messages_and_choices:
                raise ValueError(f"{item!r} is recorded by the server, which scores its recorded completions; "
                                 "messages_and_choices is for offline trajectories")
            return RecordedInput(trajectory_id=item.id)
        return MessagesInput(messages=item.messages(), tools=item.tools)
    if isinstance(item, Mapping):
        data = dict(item)
        return MessagesInput.model_validate(data) if "messages" in data else RecordedInput.model_validate(data)
    if isinstance(item, str | bytes):
        raise TypeError("an input to score is a Trajectory, a list of messages or a dict, not a string")
    return [dict(message) for message in item]


def build_rewards_requests(model: str, inputs: Iterable[ScoreInput]) -> list[RewardsRequest]:
    """The request bodies (`MAX_INPUTS` inputs each); none for no inputs. Validated here, before any request."""
    wire = [to_reward_input(item) for item in inputs]
    return [RewardsRequest(model=model, inputs=wire[start:start + MAX_INPUTS])
            for start in range(0, len(wire), MAX_INPUTS)]


class _Scoring:
    """The requests of one call and the scores so far; after the first answer, the rest name its step."""

    def __init__(self, model: str, inputs: Iterable[ScoreInput]) -> None:
        self.requests = build_rewards_requests(model, inputs)
        self.scores: list[RewardScore] = []
        self.served: str | None = None

    def bodies(self) -> Iterator[dict[str, Any]]:
        for request in self.requests:
            yield {**request.model_dump(mode="json"), "model": self.served or request.model}

    def add(self, content: bytes) -> None:
        response = RewardsResponse.model_validate_json(content)
        self.served = self.served or response.model
        offset = len(self.scores)
        self.scores.extend(s.model_copy(update={"index": s.index + offset}) for s in response.data)


async def score_with(connection: Connection, model: str, inputs: Iterable[ScoreInput]) -> list[RewardScore]:
    """One `RewardScore` per input, in order (`index` is the input's position). Scoring changes nothing on
    the server, so a request that broke off is retried like a GET."""
    scoring = _Scoring(model, inputs)
    for body in scoring.bodies():
        scoring.add((await connection.request("POST", "/v1/rewards", json=body, idempotent=True)).content)
    return scoring.scores


def score_with_sync(connection: Connection, model: str, inputs: Iterable[ScoreInput]) -> list[RewardScore]:
    scoring = _Scoring(model, inputs)
    for body in scoring.bodies():
        scoring.add(connection.request_sync("POST", "/v1/rewards", json=body, idempotent=True).content)
    return scoring.scores


async def score(
    model: TrainableModel | str,
    inputs: Iterable[ScoreInput],
    *,
    server: str | None = None,
    api_key: str | None = None,
    timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - httpx's, per request, as TrainableModel's
    retry: RetryPolicy | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[RewardScore]:
    """Score `inputs` with a reward model: one `RewardScore` (`score`: the combined score, `objectives`: each
    objective's, `tokens`) per input, in order.

        scores = await art.score(reward_model, [trajectory, [{"role": "user", ...}, {"role": "assistant", ...}]])
        scores = await art.score("rm@3", inputs, server="http://gpu-box:8000")

    `model` is a `TrainableModel` (its connection is used: `model.score(inputs)`) or a reward model's name
    (`"rm"`: the step its alias serves, `"rm@N"`: that step) on `server`, with `api_key` (default: the
    ARTLIKE_API_KEY environment variable), `timeout`, `retry` and `transport` as for a TrainableModel.
    """
    if not isinstance(model, str):
        _no_connection_options(server, api_key, transport)
        return await model.score(inputs)
    return await score_with(_connection(server, api_key, timeout, retry, transport), model, inputs)


def score_sync(
    model: TrainableModel | str,
    inputs: Iterable[ScoreInput],
    *,
    server: str | None = None,
    api_key: str | None = None,
    timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
    retry: RetryPolicy | None = None,
    transport: httpx.BaseTransport | None = None,
) -> list[RewardScore]:
    """`score` for sync code."""
    if not isinstance(model, str):
        _no_connection_options(server, api_key, transport)
        return model.score_sync(inputs)
    connection = _connection(server, api_key, timeout, retry, None, transport)
    try:
        return score_with_sync(connection, model, inputs)
    finally:
        connection.close()


def _no_connection_options(server: str | None, api_key: str | None, transport: object) -> None:
    if server is not None or api_key is not None or transport is not None:
        raise TypeError("server=, api_key= and transport= are for a model given by name; a TrainableModel "
                        "scores through its own connection")


def _connection(server: str | None, api_key: str | None, timeout: float | httpx.Timeout, retry: RetryPolicy | None,
                transport: httpx.AsyncBaseTransport | None, sync_transport: httpx.BaseTransport | None = None
                ) -> Connection:
    if server is None:
        raise TypeError("a reward model given by name needs server= (the artlike server's URL)")
    return Connection(server, api_key=api_key if api_key is not None else os.environ.get("ARTLIKE_API_KEY"),
                      timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
                      retry=retry, transport=transport, sync_transport=sync_transport)
