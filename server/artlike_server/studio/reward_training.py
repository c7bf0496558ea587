"""A reward model trained on the studio's ratings: `POST /v1/ratings/train_reward_model`. Never touches FastAPI.

1. The ratings: the train split only (held-out ratings are the promotion guard's and never train), optionally
   only those of the completions one `policy` served; one answer per rated completion, its rewards in [0, 1]
   averaged over raters (`ratings.rated_answers`); completions pruned from the log since are left out.
2. The data (`reward_model_request`, a pure function):
   - pairs: within one prompt, every (better, worse) pair of rated answers, largest margin first
     (`feedback.dpo_pairs`), as `RecordedPair`s of exactly those completions (their earlier turns are
     context), as the continual trainer's DPO pairs;
   - scores: each rated answer as a `ScoredExample` of its completion, its reward the one target (so only a
     reward model with one objective; a scale rating v is (v − 1) / 4, a thumb 0 or 1, a ranking 1 … 0).
3. The same path as every client: `TrainingService.prepare` + `start` (the /_train_model job).

    answers (prompt, reward): (a, 1.0) (a, 0.25) (b, 0.5)
    -> pairs [a: 1.0 over 0.25]; scored [1.0, 0.25, 0.5]
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence

from artlike.studio_types import RewardModelFromRatings
from artlike.types import RecordedPair, ScoredExample, TrainRequest

from ..completion_log import CompletionLog
from ..errors import InvalidRequest
from ..training.job import RunningJob, TrainingService
from .feedback import RatedAnswer, dpo_pairs
from .ratings import rated_answers
from .store import StudioStore


def reward_model_request(body: RewardModelFromRatings, answers: Sequence[RatedAnswer], *, objectives: int = 1,
                         pruned: int = 0) -> TrainRequest:
    """The training request for `body` from the rated `answers` (train split, already filtered); 400
    `too_many_objectives` for scores on a multi-objective model, 400 `no_ratings` when nothing is left."""
    if body.source != "pairs" and objectives != 1:
        raise InvalidRequest(f"{body.model!r} has {objectives} objectives and a rating is one score: train it with "
                             "\"from\": \"pairs\"", param="from", code="too_many_objectives")
    whose = f" of completions {body.policy!r} served" if body.policy is not None else ""
    if not answers:
        gone = f" ({pruned} rated completions were pruned from the log)" if pruned else ""
        raise InvalidRequest(f"no train-split ratings{whose} to train {body.model!r} on{gone}", param="policy",
                             code="no_ratings")
    pairs = [] if body.source == "scores" else [
        RecordedPair(chosen_trajectory_id=better.trajectory_id, rejected_trajectory_id=worse.trajectory_id,
                     chosen_completion_id=better.completion_id, rejected_completion_id=worse.completion_id)
        for better, worse in dpo_pairs(answers)]
    scored = [] if body.source == "pairs" else [
        ScoredExample(trajectory_id=a.trajectory_id, completion_id=a.completion_id, targets=[a.reward])
        for a in answers]
    if not pairs and not scored:
        raise InvalidRequest(f"no preference pair in the {len(answers)} rated answers{whose}: no prompt has two "
                             "rated answers that differ (train on \"from\": \"scores\" or \"both\")", param="from",
                             code="no_ratings")
    annotations: dict[str, str | int | float | bool] = {
        "source": "ratings", "rated_answers": len(answers), "pairs": len(pairs), "scored": len(scored)}
    if body.policy is not None:
        annotations["policy"] = body.policy
    return TrainRequest(model=body.model, config=body.config, pairs=pairs, scored=scored, promote=body.promote,
                        annotations=annotations)


async def train_reward_model(body: RewardModelFromRatings, studio: StudioStore, log: CompletionLog,
                             training: TrainingService) -> RunningJob:
    """Start the training job (its events are the /_train_model stream); 404 for an unknown model, 400
    `wrong_model_kind` for a policy, the request's 400s, and whatever `prepare` refuses."""
    model = training.store.require(body.model)
    if model.kind != "reward":
        raise InvalidRequest(f"{body.model!r} is a policy: ratings train a reward model here (register one with "
                             "kind 'reward')", param="model", code="wrong_model_kind")
    stored = await asyncio.to_thread(lambda: studio.list_ratings(model=body.policy, split="train"))
    answers = rated_answers(stored)
    present = await log.read(lambda db: recorded_ids(db, [a.completion_id for a in answers]))
    kept = [a for a in answers if a.completion_id in present]
    request = reward_model_request(body, kept, objectives=model.reward_head.num_objectives if model.reward_head
                                   else 1, pruned=len(answers) - len(kept))
    return training.start(await training.prepare(request))


class RatingsRewardTrainer:
    """`train_reward_model` over this server's studio store, completion log and training service."""

    def __init__(self, studio: StudioStore, log: CompletionLog, training: TrainingService) -> None:
        self._studio = studio
        self._log = log
        self._training = training

    async def start(self, body: RewardModelFromRatings) -> RunningJob:
        return await train_reward_model(body, self._studio, self._log, self._training)


def recorded_ids(connection: sqlite3.Connection, ids: Sequence[int]) -> set[int]:
    """Which of these completion ids the log still holds (no bodies or tokens read)."""
    found: set[int] = set()
    for start in range(0, len(ids), 500):
        chunk = list(ids[start:start + 500])
        query = f"SELECT id FROM completions WHERE id IN ({', '.join('?' * len(chunk))})"
        found.update(row[0] for row in connection.execute(query, chunk))
    return found
