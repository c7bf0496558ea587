"""Continual training from ratings: a background task per model that trains a step every K new ratings.

Off by default; a model's policy (`ContinualPolicy`, in the studio store) switches it on. After each rating
(`notify`), if at least `every` train-split ratings arrived since the last attempt and none of them trained
yet, a run starts:

1. The answers: every rated answer of the prompts the new ratings touch (older ratings of those prompts
   give the group its baseline), plus `replay` older rated answers of other prompts, sampled at random, so
   that the newest few ratings do not wipe out what the earlier ones taught.
2. GRPO groups (`feedback.grpo_groups`) or DPO pairs (`feedback.dpo_pairs`) of exactly the rated completions
   (`completion_ids`: token-exact, earlier turns of their trajectory as context).
3. The same path as every client: `TrainingService.prepare` + `start` (the /_train_model job), its events
   kept for the page. With the guard on, the step is committed unpromoted (`name@N`), judged on held-out
   ratings (`guard.judge`) and promoted only if it passes; the history says why either way.
No signal (all new ratings equal) is not an error: the run says so and waits for `every` more ratings.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, NoReturn

import httpx

from artlike.studio_types import ContinualPolicy, ContinualPolicyUpdate, ContinualRun, ContinualStatus
from artlike.types import (
    DoneEvent,
    DPOConfig,
    ErrorEvent,
    GRPOConfig,
    RecordedPair,
    TrainGroup,
    TrainRequest,
    TrajectoryRef,
)

from ..completion_log import CompletionLog
from ..completion_queries import completions_by_id
from ..engine.client import AdapterEngine, EngineRequestError
from ..errors import APIError, Conflict, InvalidRequest
from ..models.manager import ModelManager
from ..training.job import TrainingService
from . import guard
from .feedback import RatedAnswer, dpo_pairs, grpo_groups
from .ratings import rated_answers
from .store import StoredRating, StudioStore

log = logging.getLogger(__name__)

BUSY_RETRY_S = 5.0  # the model is training (another job, a session): look again this much later
MAX_EVENTS = 200  # events kept per run for the page


class ContinualTrainer:
    def __init__(self, store: StudioStore, training: TrainingService, models: ModelManager, log: CompletionLog,
                 engine: AdapterEngine) -> None:
        self.store = store
        self.training = training
        self.models = models
        self.log = log
        self.engine = engine
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._state: dict[str, str] = {}
        self._runs: dict[str, ContinualRun] = {}
        self._again: set[str] = set()  # notified while its task was running: look once more before ending
        self._stopping = False

    # ------------------------------------------------------------------------------------ control

    def start(self) -> None:
        """Look at every model whose policy is on (ratings may have arrived while the server was down)."""
        for model in self.store.enabled_models():
            self.notify(model)

    def notify(self, model: str) -> None:
        """A rating of `model` arrived (or its policy changed): start a run if one is due and none is going."""
        if self._stopping or self.models.latest_step(model) is None:
            return
        if model in self._tasks:  # its loop may have just read the ratings: make it read them once more
            self._again.add(model)
            return
        self._tasks[model] = asyncio.create_task(self._run_while_due(model), name=f"continual:{model}")

    async def shutdown(self) -> None:
        self._stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    async def update_policy(self, model: str, update: ContinualPolicyUpdate) -> ContinualStatus:
        self.training.store.require(model)
        policy = await asyncio.to_thread(self.store.policy, model)
        merged = ContinualPolicy.model_validate(policy.model_dump() | update.model_dump(exclude_none=True))
        await asyncio.to_thread(self.store.set_policy, model, merged)
        self.notify(model)
        return await self.status(model)

    async def status(self, model: str) -> ContinualStatus:
        self.training.store.require(model)
        policy = await asyncio.to_thread(self.store.policy, model)
        pending = await asyncio.to_thread(self.store.count, model, untrained=True)
        trained = await asyncio.to_thread(self.store.count, model, untrained=False)
        live = self.models.latest_step(model)
        state = self._state.get(model) if model in self._tasks else None
        state = state or ("waiting" if policy.enabled else "off")
        run = self._runs.get(model)
        message = f"step {live} live, trained on {trained} rating{'s' if trained != 1 else ''}"
        if state == "waiting":
            # After a run without signal its ratings still wait, but only newer ones make the next run due.
            attempted = await asyncio.to_thread(self.store.attempted_through, model)
            fresh = await asyncio.to_thread(self.store.count, model, untrained=True, after=attempted)
            message += f"; {fresh} of {policy.every} new ratings for the next step"
            if pending > fresh:
                message += f" ({pending} untrained in all)"
        elif state in ("training", "evaluating"):
            message += f"; {state} a step on {run.ratings if run else pending} new ratings"
        return ContinualStatus(model=model, policy=policy, state=state, pending_ratings=pending,
                               trained_ratings=trained, live_step=live, message=message, last_run=run)

    # -------------------------------------------------------------------------------------- runs

    async def _run_while_due(self, model: str) -> None:
        try:
            while not self._stopping:
                self._again.discard(model)
                policy = await asyncio.to_thread(self.store.policy, model)
                pending = await asyncio.to_thread(
                    lambda: [r for r in self.store.list_ratings(model=model, untrained=True, split="train")
                             if r.rating.reward is not None])
                attempted = await asyncio.to_thread(self.store.attempted_through, model)
                if not policy.enabled or sum(r.rating.id > attempted for r in pending) < policy.every:
                    if model in self._again:  # a rating arrived while this looked: look again
                        continue
                    return
                if self.training.is_training(model):
                    self._state[model] = "waiting"
                    await asyncio.sleep(BUSY_RETRY_S)
                    continue
                await self._run_once(model, policy, pending)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: logged with its traceback, the next rating tries again
            log.exception("continual training of %r failed", model)
        finally:  # no await between the last look and this: a later notify starts a new task
            self._state.pop(model, None)
            self._tasks.pop(model, None)

    async def _run_once(self, model: str, policy: ContinualPolicy, pending: list[StoredRating]) -> None:
        answers, replayed = await asyncio.to_thread(self._answers, model, policy, pending)
        run = ContinualRun(started_at=time.time(), ratings=len(pending), replayed=replayed)
        self._runs[model] = run
        self._state[model] = "training"
        through = max(r.rating.id for r in pending)
        try:
            request = self._request(model, policy, answers, {r.rating.completion_id for r in pending}, len(pending),
                                    replayed)
            prepared = await self.training.prepare(request)
            job = self.training.start(prepared)
        except Conflict as error:  # another job started meanwhile: try again later, nothing consumed
            run.reason = f"waiting: {error.message}"
            run.finished_at = time.time()
            await asyncio.sleep(BUSY_RETRY_S)
            return
        except APIError as error:  # no signal, ratings of pruned completions ...: wait for `every` more
            run.reason = f"no step: {error.message}"
            run.finished_at = time.time()
            await asyncio.to_thread(self.store.set_attempted_through, model, through)
            return
        async for event in job.stream():
            if len(run.events) < MAX_EVENTS:
                run.events.append(event.model_dump(mode="json"))
            if isinstance(event, DoneEvent):
                run.step = event.step
            elif isinstance(event, ErrorEvent):
                run.reason = f"training failed: {event.message}"
        await asyncio.to_thread(self.store.set_attempted_through, model, through)
        if run.step is None:
            run.finished_at = time.time()
            return
        await asyncio.to_thread(self.store.mark_trained, [r.rating.id for r in pending], run.step)
        if policy.guard.enabled:
            self._state[model] = "evaluating"
            try:
                await self._judge(model, policy, run)
            except (httpx.TransportError, EngineRequestError, APIError) as error:  # the engine, not the step
                run.promoted = False
                run.reason = (f"not promoted: the guard could not score step {run.step} ({error}); promote it with "
                              "POST .../alias if it is good")
        else:
            run.promoted, run.reason = True, f"step {run.step} trained on {len(pending)} ratings and served"
        run.finished_at = time.time()

    async def _judge(self, model: str, policy: ContinualPolicy, run: ContinualRun) -> None:
        assert run.step is not None
        live = self.models.latest_step(model)
        assert live is not None
        held_out = rated_answers(await asyncio.to_thread(lambda: self.store.list_ratings(model=model,
                                                                                       split="holdout")))
        ids = [a.completion_id for a in held_out]
        records = await self.log.read(lambda db: completions_by_id(db, ids))
        verdict = await guard.judge(self.engine, self.models, model, run.step, live, held_out, records, policy.guard)
        run.guard, run.promoted, run.reason = verdict, verdict.promoted, verdict.reason
        if verdict.promoted:
            await self.models.set_alias(model, run.step, reason=f"continual training: {verdict.reason}")
        else:
            await asyncio.to_thread(self.training.store.append_history, model, {
                "event": "guard", "candidate_step": run.step, "live_step": live, "promoted": False,
                "shift": verdict.shift, "answers": verdict.answers, "reason": verdict.reason, "time": time.time()})

    def _answers(self, model: str, policy: ContinualPolicy, pending: list[StoredRating]
                 ) -> tuple[list[RatedAnswer], int]:
        """The rated answers of the prompts `pending` touches, plus a replay sample of other prompts' answers."""
        prompts = {r.prompt_key for r in pending}
        context = [r for r in self.store.ratings_of_prompts(model, prompts) if r.rating.split == "train"]
        answers = rated_answers(context)
        older = [a for a in rated_answers([r for r in self.store.list_ratings(model=model, untrained=False,
                                                                               split="train")
                                           if r.prompt_key not in prompts])]
        rng = random.Random(max(r.rating.id for r in pending))  # reproducible for one set of ratings
        replay = rng.sample(older, min(policy.replay, len(older)))
        return answers + replay, len(replay)

    @staticmethod
    def _request(model: str, policy: ContinualPolicy, answers: list[RatedAnswer], new: set[int], ratings: int,
                 replayed: int) -> TrainRequest:
        """The training request of a run; no signal unless a group or pair holds a newly rated answer (replay
        alone would only train the old ratings again)."""
        annotations: dict[str, Any] = {"source": "ratings", "ratings": ratings, "replayed": replayed}
        promote = not policy.guard.enabled
        if policy.objective == "dpo":
            pairs = [RecordedPair(chosen_trajectory_id=better.trajectory_id, rejected_trajectory_id=worse.trajectory_id,
                                  chosen_completion_id=better.completion_id, rejected_completion_id=worse.completion_id)
                     for better, worse in dpo_pairs(answers)]
            if not any({p.chosen_completion_id, p.rejected_completion_id} & new for p in pairs):
                raise_no_signal("no two rated answers of one prompt differ, so there is no preference pair")
            return TrainRequest(model=model, config=DPOConfig(learning_rate=policy.learning_rate, epochs=policy.epochs,
                                                              beta=policy.beta),
                                pairs=pairs, promote=promote, annotations=annotations)
        groups = grpo_groups(answers)
        if not any(a.completion_id in new for group in groups for a in group):
            raise_no_signal(f"the {ratings} new ratings give their answers the same reward")
        return TrainRequest(
            model=model, config=GRPOConfig(learning_rate=policy.learning_rate, epochs=policy.epochs),
            groups=[TrainGroup(trajectories=[TrajectoryRef(trajectory_id=a.trajectory_id, reward=a.reward,
                                                           completion_ids=[a.completion_id]) for a in group])
                    for group in groups],
            promote=promote, annotations=annotations)


def raise_no_signal(why: str) -> NoReturn:
    raise InvalidRequest(f"nothing to learn yet: {why}; waiting for more ratings", code="no_signal")
