"""`art.score(...)`: a reward model's scores of conversations, the model given as a `TrainableModel` or by name
(the inputs and the requests: `_rewards`)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import httpx

from ._backend import Backend
from ._http import DEFAULT_TIMEOUT, Connection, RetryPolicy
from ._model import TrainableModel
from ._rewards import MAX_INPUTS, ScoreInput, score_with
from ._syncify import run_sync
from .types import RewardScore

__all__ = ["MAX_INPUTS", "ScoreInput", "score", "score_sync"]


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
    return await _score(model, inputs, server, api_key, timeout, retry, transport, None)


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
    """`score` for sync code (`transport`: a sync one)."""
    return run_sync(_score(model, inputs, server, api_key, timeout, retry, None, transport))


async def _score(model: TrainableModel | str, inputs: Iterable[ScoreInput], server: str | None, api_key: str | None,
                 timeout: float | httpx.Timeout,  # noqa: ASYNC109 - httpx's, per request
                 retry: RetryPolicy | None, transport: httpx.AsyncBaseTransport | None,
                 sync_transport: httpx.BaseTransport | None) -> list[RewardScore]:
    if not isinstance(model, str):
        _no_connection_options(server, api_key, transport or sync_transport)
        return await model.score(inputs)
    connection = _connection(server, api_key, timeout, retry, transport, sync_transport)
    try:
        return await score_with(Backend(connection), model, inputs)
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
