"""Scoring conversations with a reward model: resolve the step, turn each input into token ids exactly as
training does (recorded completions: their prompt and sampled ids; messages: the served chat template, as
an offline trajectory), and ask the trainer worker, which answers between two micro-batches of a running
job. Never touches FastAPI."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from artlike.types import (
    CompletionRecord,
    MessagesInput,
    RecordedInput,
    RewardInput,
    RewardScore,
    RewardsRequest,
    RewardsResponse,
)

from ..completion_log import CompletionLog
from ..completion_queries import completions_by_id
from ..errors import InvalidRequest, NotFound, ServiceUnavailable
from ..models.manager import ModelManager, served_name
from ..models.store import ModelStore
from ..trainer_ipc.sequences import SequenceBuildError
from ..training.trainer_client import TrainerCrashed, TrainerError, TrainerProcess, TrainerTimeout

MAX_INPUT_TOKENS_DEFAULT = 4096

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
"""A conversation's token ids as training renders it (`TrainingService.conversation_ids`)."""


class RewardScoring:
    def __init__(self, store: ModelStore, models: ModelManager, log: CompletionLog, trainer: TrainerProcess,
                 render: Render, *, max_input_tokens: int = MAX_INPUT_TOKENS_DEFAULT) -> None:
        self.store = store
        self.models = models
        self.log = log
        self.trainer = trainer
        self._render_ids = render
        self.max_input_tokens = max_input_tokens

    async def score(self, request: RewardsRequest) -> RewardsResponse:
        served = self.models.resolve_reward_model(request.model)
        assert served.model is not None and served.step is not None
        head = self.store.require(served.model).reward_head
        assert head is not None, "a reward model is registered with its head"
        token_ids = await self.token_ids(request.inputs)
        try:
            result = await self.trainer.score(self.store.step_dir(served.model, served.step), token_ids)
        except TrainerError as error:
            raise InvalidRequest(f"the trainer could not score: {error.message}", param="inputs",
                                 code="scoring_failed") from None
        except (TrainerCrashed, TrainerTimeout) as error:
            raise ServiceUnavailable(f"the trainer is not available: {error}", retry_after=30.0,
                                     code="trainer_unavailable") from None
        names = head.names
        return RewardsResponse(model=served_name(served.model, served.step), data=[
            RewardScore(index=i, score=combined, objectives=dict(zip(names, scores, strict=True)),
                        tokens=len(token_ids[i]))
            for i, (scores, combined) in enumerate(zip(result.scores, result.combined, strict=True))
        ])

    async def token_ids(self, inputs: list[RewardInput]) -> list[list[int]]:
        """Each input's token ids (4xx for an unknown completion, a conversation without an answer, or one
        over the length limit)."""
        wanted = {i.completion_id for i in inputs if isinstance(i, RecordedInput) and i.completion_id is not None}
        trajectories = {i.trajectory_id for i in inputs if isinstance(i, RecordedInput) and i.completion_id is None}
        records = await self.log.read(lambda db: completions_by_id(db, sorted(wanted))) if wanted else {}
        recorded = await self.log.read_for_training([t for t in trajectories if t is not None]) if trajectories else {}
        last_of: dict[str, CompletionRecord] = {tid: records[-1] for tid, records in recorded.items() if records}
        result: list[list[int]] = []
        for index, item in enumerate(inputs):
            param = f"inputs[{index}]"
            if isinstance(item, RecordedInput):
                record = records.get(item.completion_id) if item.completion_id is not None \
                    else last_of.get(item.trajectory_id or "")
                if record is None or (item.trajectory_id is not None and record.trajectory_id != item.trajectory_id):
                    raise NotFound(f"{param}: no recorded completion {item.completion_id or ''} "
                                   f"{'of trajectory ' + repr(item.trajectory_id) if item.trajectory_id else ''}",
                                   param=param, code="completion_not_found")
                ids = [*record.prompt_token_ids, *record.output_token_ids]
            else:
                messages = item.messages if isinstance(item, MessagesInput) else item
                tools = item.tools if isinstance(item, MessagesInput) else None
                ids = await asyncio.to_thread(self._render, messages, tools, param)
            if len(ids) > self.max_input_tokens:
                raise InvalidRequest(f"{param} has {len(ids)} tokens, over this server's limit of "
                                     f"{self.max_input_tokens}", param=param, code="input_too_long")
            result.append(ids)
        return result

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, param: str) -> list[int]:
        """A conversation's ids as training renders it: the answer (the last assistant message) and its prompt."""
        if not messages or messages[-1].get("role") != "assistant":
            raise InvalidRequest(f"{param}: a conversation to score ends with the assistant's answer",
                                 param=param, code="invalid_input")
        try:
            return self._render_ids(messages, tools)
        except (SequenceBuildError, ValueError, TypeError) as error:
            raise InvalidRequest(f"{param}: {error}", param=param, code="invalid_input") from None
