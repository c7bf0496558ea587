"""Scoring conversations with a reward model: the inputs' wire form and the requests of one call to
`POST /v1/rewards` (`art.score` and `model.score` both come here).

An input is a recorded `Trajectory` (sent as `{"trajectory_id"}`: the server scores its last recorded
completion with its prompt, token-exact), an offline one (its messages and tools, rendered with the served
chat template), a list of chat messages ending with the assistant's answer, or a dict in the wire's shapes
(`{"messages", "tools"?}`, `{"trajectory_id"?, "completion_id"?}`).

More inputs than one request takes (`MAX_INPUTS`) go in several requests, all scored by the step the first
one resolved (`name@N`), so one call never mixes two steps of the reward model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ._backend import Backend
from ._trajectory import Trajectory
from .types import MessagesInput, RecordedInput, RewardScore, RewardsRequest, RewardsResponse

__all__ = ["MAX_INPUTS", "ScoreInput", "score_with"]

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

    def add(self, response: RewardsResponse) -> None:
        self.served = self.served or response.model
        offset = len(self.scores)
        self.scores.extend(s.model_copy(update={"index": s.index + offset}) for s in response.data)


async def score_with(backend: Backend, model: str, inputs: Iterable[ScoreInput]) -> list[RewardScore]:
    """One `RewardScore` per input, in order (`index` is the input's position)."""
    scoring = _Scoring(model, inputs)
    for body in scoring.bodies():
        scoring.add(await backend.score(body))
    return scoring.scores
