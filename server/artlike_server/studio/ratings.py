"""Ratings of recorded completions: take them (API and page alike), list and export them, pair them, and
find what nobody rated yet (the inbox). Never touches FastAPI; errors are `errors.APIError`s."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from artlike.studio_types import (
    InboxItem,
    RankingRating,
    RatedPair,
    Rating,
    RatingRequest,
    SkipRating,
)
from artlike.types import CompletionRecord

from ..completion_log import CompletionLog
from ..completion_queries import CompletionFilter, completions_by_id, newest_completions, request_metadata
from ..errors import InvalidRequest, NotFound
from .feedback import RatedAnswer, dpo_pairs, is_holdout, rating_reward
from .store import NewRating, StoredRating, StudioStore

Decoder = Callable[[list[int]], str]


def prompt_key(record: CompletionRecord) -> str:
    """Answers to the same prompt tokens share a key (the GRPO group of ratings)."""
    return hashlib.sha1(b"".join(t.to_bytes(4, "little", signed=True) for t in record.prompt_token_ids)).hexdigest()


def model_of(record: CompletionRecord) -> str:
    """The trainable model that served a completion ("name" of "name@N"), or the base model id."""
    return record.served_model.rpartition("@")[0] if record.step is not None else record.served_model


def prompt_messages(record: CompletionRecord, decode: Decoder) -> list[dict[str, Any]]:
    """The prompt as chat messages, whichever API it came through (the decoded prompt as a last resort)."""
    body = record.request
    if isinstance(body.get("messages"), list):
        system = body.get("system")  # Anthropic Messages keep the system prompt beside the messages
        head = [{"role": "system", "content": system}] if isinstance(system, str) else []
        return head + list(body["messages"])
    if "input" in body:  # the Responses API
        given = body["input"]
        head = [{"role": "system", "content": body["instructions"]}] if isinstance(body.get("instructions"), str) \
            else []
        return head + (list(given) if isinstance(given, list) else [{"role": "user", "content": str(given)}])
    if isinstance(body.get("prompt"), str):
        return [{"role": "user", "content": body["prompt"]}]
    return [{"role": "user", "content": decode(record.prompt_token_ids)}]


class RatingService:
    def __init__(self, store: StudioStore, log: CompletionLog, decode: Decoder,
                 on_rated: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.log = log
        self.decode = decode  # blocking (a tokenizer): called in threads
        self.on_rated = on_rated

    async def rate(self, request: RatingRequest, *, default_rater: str = "api") -> list[Rating]:
        ids = request.completion_ids if isinstance(request, RankingRating) else [request.completion_id]
        records = await self.log.read(lambda db: completions_by_id(db, ids))
        missing = [i for i in ids if i not in records]
        if missing:
            raise NotFound(f"no recorded completion with id {missing[0]}",
                           param="completion_ids" if isinstance(request, RankingRating) else "completion_id",
                           code="completion_not_found")
        if isinstance(request, RankingRating) and len({model_of(r) for r in records.values()}) > 1:
            raise InvalidRequest("a ranking compares answers of one model", param="completion_ids",
                                 code="invalid_ranking")
        rater = request.rater or default_rater
        ranking_id = f"rank_{uuid.uuid4().hex[:16]}" if isinstance(request, RankingRating) else None
        model = model_of(records[ids[0]])  # one model per request (a ranking of several is refused above)
        guard = (await asyncio.to_thread(self.store.policy, model)).guard
        new = []
        for position, completion_id in enumerate(ids):
            record = records[completion_id]
            key = prompt_key(record)
            split = request.split
            if split == "auto":
                split = "holdout" if guard.enabled and is_holdout(key, guard.holdout_fraction) else "train"
            if isinstance(request, RankingRating):
                value: str | int | None = position
                reward = rating_reward("ranking", None, rank=position, ranked=len(ids))
            else:
                value = None if isinstance(request, SkipRating) else request.value
                reward = rating_reward(request.kind, value)
            new.append(NewRating(completion_id, record.trajectory_id, model, record.step, key, request.kind, value,
                                 reward, ranking_id, request.comment, rater, split))
        ratings = await asyncio.to_thread(self.store.add_ratings, new)
        if self.on_rated is not None:
            self.on_rated(ratings[0].model)
        return ratings

    async def find(self, **filters: Any) -> list[Rating]:
        return [s.rating for s in await asyncio.to_thread(lambda: self.store.list_ratings(**filters))]

    async def export(self, ratings: Sequence[Rating]) -> list[dict[str, Any]]:
        """Ratings with the prompt (messages) and the response text, for JSONL export."""
        records = await self.log.read(lambda db: completions_by_id(db, [r.completion_id for r in ratings]))

        def rows() -> list[dict[str, Any]]:
            out = []
            for rating in ratings:
                record = records.get(rating.completion_id)
                extra = {"prompt": prompt_messages(record, self.decode),
                         "response": self.decode(record.output_token_ids)} if record else {}
                out.append(rating.model_dump() | extra)
            return out

        return await asyncio.to_thread(rows)

    async def pairs(self, model: str | None) -> list[RatedPair]:
        """Chosen/rejected pairs of each prompt's rated answers (train and held-out alike)."""
        stored = await asyncio.to_thread(lambda: self.store.list_ratings(model=model))
        answers = rated_answers(stored)
        pairs = dpo_pairs(answers)
        ids = [a.completion_id for pair in pairs for a in pair]
        records = await self.log.read(lambda db: completions_by_id(db, ids))

        def build() -> list[RatedPair]:
            out = []
            for better, worse in pairs:
                chosen, rejected = records.get(better.completion_id), records.get(worse.completion_id)
                if chosen is None or rejected is None:  # pruned from the log since
                    continue
                out.append(RatedPair(
                    prompt=prompt_messages(chosen, self.decode),
                    chosen=[{"role": "assistant", "content": self.decode(chosen.output_token_ids)}],
                    rejected=[{"role": "assistant", "content": self.decode(rejected.output_token_ids)}],
                    chosen_completion_id=better.completion_id, rejected_completion_id=worse.completion_id,
                    margin=better.reward - worse.reward))
            return out

        return await asyncio.to_thread(build)

    async def inbox(self, *, model: str | None, step: int | None, metadata: Mapping[str, str], before: int | None,
                    limit: int) -> tuple[list[InboxItem], bool]:
        """Recorded completions nobody rated, newest first; scans back page by page until `limit` are found."""
        where = CompletionFilter(model=model, step=step, metadata=metadata)
        found: list[CompletionRecord] = []
        cursor = before
        exhausted = False
        for _ in range(20):  # bounded: at most 20 pages of the log per request
            page = await self.log.read(partial(newest_completions, where=where, before=cursor, limit=200))
            if not page:
                exhausted = True
                break
            rated = await asyncio.to_thread(self.store.rated_completion_ids, [r.id for r in page])
            found.extend(r for r in page if r.id not in rated)
            cursor = page[-1].id
            if len(found) > limit:
                break
        has_more = len(found) > limit or not exhausted
        chosen = found[:limit]

        def items() -> list[InboxItem]:
            return [InboxItem(completion_id=r.id, trajectory_id=r.trajectory_id, model=model_of(r),
                              served_model=r.served_model, step=r.step, created_at=r.created_at,
                              messages=prompt_messages(r, self.decode),
                              response={"content": self.decode(r.output_token_ids)},
                              metadata=request_metadata(r)) for r in chosen]

        return await asyncio.to_thread(items), has_more


def rated_answers(stored: Sequence[StoredRating]) -> list[RatedAnswer]:
    """One answer per rated completion (skips left out), its rewards averaged over raters."""
    rewards: dict[int, list[float]] = {}
    first: dict[int, StoredRating] = {}
    for s in stored:
        if s.rating.reward is None:
            continue
        rewards.setdefault(s.rating.completion_id, []).append(s.rating.reward)
        first.setdefault(s.rating.completion_id, s)
    return [RatedAnswer(cid, first[cid].rating.trajectory_id, first[cid].prompt_key, sum(r) / len(r))
            for cid, r in rewards.items()]
