"""Browsing recorded trajectories: a filtered list (with the reward each was trained with and its ratings)
and one trajectory decoded for people: messages, tool calls, the response and every sampled token with its
logprob. Never touches FastAPI."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from artlike.studio_types import CompletionView, TokenView, TrajectoryListItem, TrajectoryView

from ..completion_log import CompletionLog
from ..completion_queries import CompletionFilter, newest_trajectories
from ..errors import NotFound
from .ratings import model_of, prompt_messages
from .store import StudioStore


class TrajectoryBrowser:
    def __init__(self, log: CompletionLog, store: StudioStore, decode_text: Callable[[list[int]], str],
                 decode_tokens: Callable[[list[int]], list[str]]) -> None:
        self.log = log
        self.store = store
        self.decode_text = decode_text  # blocking (a tokenizer): called in threads
        self.decode_tokens = decode_tokens

    async def list(self, *, model: str | None, step: int | None, metadata: Mapping[str, str],
                   since: float | None, until: float | None, min_reward: float | None, max_reward: float | None,
                   before: int | None, limit: int) -> tuple[list[TrajectoryListItem], bool]:
        ids = None
        if min_reward is not None or max_reward is not None:  # rewards live in the studio store
            ids = await asyncio.to_thread(self.store.trajectories_with_reward, min_reward, max_reward)
            if not ids:
                return [], False
        where = CompletionFilter(model=model, step=step, metadata=metadata, since=since, until=until,
                                 trajectory_ids=ids)
        rows = await self.log.read(lambda db: newest_trajectories(db, where, before=before, limit=limit + 1))
        page = rows[:limit]
        tids = [row.trajectory_id for row in page]
        rewards = await asyncio.to_thread(self.store.rewards, tids)
        ratings = await asyncio.to_thread(self.store.rating_means, tids)
        items = [TrajectoryListItem(trajectory_id=row.trajectory_id, models=row.models, steps=row.steps,
                                    completions=row.completions, created_at=row.created_at, last_id=row.last_id,
                                    reward=rewards.get(row.trajectory_id), rating=ratings.get(row.trajectory_id),
                                    metadata=row.metadata) for row in page]
        return items, len(rows) > limit

    async def view(self, trajectory_id: str) -> TrajectoryView:
        records = await self.log.get(trajectory_id)
        if not records:
            raise NotFound(f"trajectory {trajectory_id!r} has no recorded completions", param="trajectory_id",
                           code="trajectory_not_found")
        reward = (await asyncio.to_thread(self.store.rewards, [trajectory_id])).get(trajectory_id)

        def build() -> TrajectoryView:
            completions = []
            for r in records:
                texts = self.decode_tokens(r.output_token_ids)
                tools = r.request.get("tools")
                completions.append(CompletionView(
                    id=r.id, model=model_of(r), served_model=r.served_model, step=r.step, created_at=r.created_at,
                    finish_reason=r.finish_reason, messages=prompt_messages(r, self.decode_text),
                    tools=tools if isinstance(tools, list) else None,
                    response={"content": self.decode_text(r.output_token_ids)},
                    tokens=[TokenView(text=t, logprob=lp) for t, lp in zip(texts, r.logprobs, strict=True)]))
            return TrajectoryView(trajectory_id=trajectory_id, reward=reward, completions=completions)

        return await asyncio.to_thread(build)
