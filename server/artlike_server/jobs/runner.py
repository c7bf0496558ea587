"""Run one managed job: a client of this server that happens to live inside it.

Reinforcement, per iteration: take `batch_size` rows (a seeded shuffle per epoch, so a resumed job sees the
rows it would have seen), roll out `group_size` episodes per row through the server's own trajectory URLs
(so every rollout is recorded and browsable like any agent's), score them (sandbox or graders), train one
GRPO step through `/_train_model` (which hot-swaps it) and record a checkpoint. Validation rows are scored
before the first iteration, every `eval.interval` iterations and after the last. The spec's `remedies`
(against a flattening curve) add rows to an iteration whose groups carry too little signal (dynamic
sampling), schedule the temperature, group size and learning rate over iterations, set the step's
entropy bonus and clip, and add a row's reference answer to a group whose rollouts all failed (guidance);
each iteration's metrics say how many groups had no signal and how the rows' pass rates spread.

Supervised and DPO jobs are one `/_train_model` call over the whole dataset (`iterations` = epochs).

Stopping: `StopFlag.request("cancel" | "pause")`. Rollouts in flight are abandoned (nothing of them is
trained); a training step in flight finishes and is kept, so the last good step stays served.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

import openai

import artlike as art

from ..training.advantages import is_zero_variance
from ..training.diagnostics import group_statistics
from .datasets import PromptRow, parse_chat_examples, parse_preference_rows, parse_prompt_rows
from .episodes import run_episode
from .guidance import ROW_METADATA, Guided, guide_groups
from .rewards import JobReward
from .spec import IterationSettings, JobSpec
from .store import JobRecord, JobStore

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_REWARD_ERROR_EVENTS = 3  # the first tracebacks of a job appear in its events; later ones are counted
ROLLOUT_FAILURE_BUDGET = 0.25  # rollouts (not rewards) that may fail per iteration before the job fails
TRAIN_CONFLICT_RETRY_S = 5.0
TRAIN_CONFLICT_RETRIES = 120  # someone else trains this model: wait up to 10 minutes for them


Outcome = Literal["succeeded", "failed", "cancelled", "paused"]


class JobFailed(Exception):
    def __init__(self, message: str, *, code: str = "job_failed") -> None:
        super().__init__(message)
        self.code = code


class Stopped(Exception):
    pass


class StopFlag:
    """Set by cancel/pause requests; the runner checks it between phases and races rollouts against it."""

    def __init__(self) -> None:
        self.requested: Literal["cancel", "pause"] | None = None
        self._event = asyncio.Event()

    def request(self, what: Literal["cancel", "pause"]) -> None:
        if self.requested != "cancel":  # cancel wins over pause
            self.requested = what
        self._event.set()

    async def interruptible(self, awaitable: Awaitable[T]) -> T:
        """Await it unless a stop is requested first; then cancel it and raise Stopped."""
        work = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise Stopped

    def check(self) -> None:
        if self.requested is not None:
            raise Stopped


@dataclass(frozen=True)
class ServerAccess:
    """How the job reaches this server: its own URL and key (the same routes any client uses)."""

    base_url: str
    api_key: str | None


def batch_rows(rows: list[PromptRow], *, iteration: int, batch_size: int, seed: int) -> list[PromptRow]:
    """The rows of one iteration: consecutive slices of a fresh seeded permutation per epoch.

    >>> rows = [PromptRow(line=i, messages=[], tools=None, item={}) for i in range(1, 5)]
    >>> [r.line for r in batch_rows(rows, iteration=0, batch_size=3, seed=1)] == \\
    ...     [r.line for r in batch_rows(rows, iteration=0, batch_size=3, seed=1)]
    True
    """
    n = len(rows)
    chosen: list[PromptRow] = []
    for position in range(iteration * batch_size, iteration * batch_size + min(batch_size, n)):
        epoch, index = divmod(position, n)
        order = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        chosen.append(rows[order[index]])
    return chosen


def resample_rows(rows: list[PromptRow], *, iteration: int, start: int, count: int, seed: int) -> list[PromptRow]:
    """Rows that dynamic sampling adds to an iteration: positions `start`… of a seeded permutation of its own
    (cycling), so a resumed iteration draws the same rows again.

    >>> rows = [PromptRow(line=i, messages=[], tools=None, item={}) for i in range(1, 4)]
    >>> first = [r.line for r in resample_rows(rows, iteration=2, start=0, count=2, seed=0)]
    >>> later = [r.line for r in resample_rows(rows, iteration=2, start=2, count=4, seed=0)]
    >>> first + later[:1] == [r.line for r in resample_rows(rows, iteration=2, start=0, count=3, seed=0)]
    True
    >>> sorted(first + later[:1]), later[1:] == first + later[:1]
    ([1, 2, 3], True)
    """
    order = list(range(len(rows)))
    random.Random(f"{seed}:resample:{iteration}").shuffle(order)
    return [rows[order[position % len(rows)]] for position in range(start, start + count)]


def _has_signal(group: art.TrajectoryGroup) -> bool:
    """Whether the group's rewards differ: GRPO learns only from such groups."""
    return not is_zero_variance([t.reward for t in group.trajectories if t.reward is not None])


def _step_metrics(result: art.TrainResult) -> dict[str, float]:
    """The trainer's side of a step: the policy's entropy, the objective's own statistics (`clip_cov_fraction`)
    and, when measured, the KL to the base model."""
    metrics: dict[str, float] = {}
    if result.metrics:
        metrics["entropy"] = statistics.fmean(s.entropy for s in result.metrics)
        metrics |= result.objective_metrics
        kl = [s.kl_to_base for s in result.metrics if s.kl_to_base is not None]
        if kl:
            metrics["kl_to_base"] = statistics.fmean(kl)
    if result.start is not None:
        optional = {"sampling_entropy": result.start.sampling_entropy,
                    "response_tokens_mean": result.start.response_tokens_mean}
        metrics |= {name: value for name, value in optional.items() if value is not None}
    return metrics


class JobRunner:
    def __init__(self, store: JobStore, job_id: str, server: ServerAccess, reward: JobReward | None,
                 stop: StopFlag) -> None:
        self.store = store
        self.job_id = job_id
        self.server = server
        self.reward = reward
        self.stop = stop
        self.spec: JobSpec = store.get(job_id).spec  # immutable: read once, not per access
        self._warned: Counter[str] = Counter()  # warnings of each kind so far: only the first few become events

    @property
    def job(self) -> JobRecord:
        return self.store.get(self.job_id)


    def event(self, message: str, *, level: Literal["info", "warn", "error"] = "info",
              metrics: dict[str, Any] | None = None) -> None:
        self.store.add_event(self.job_id, message, level=level, type="metrics" if metrics else "message",
                             data=metrics)

    async def run(self) -> Outcome:
        """Run (or resume) the job to its end; raises JobFailed with the reason when it cannot go on."""
        spec = self.spec
        async with art.TrainableModel(spec.target_model, spec.base_model, self.server.base_url,
                                      api_key=self.server.api_key) as model:
            if spec.create_target:
                await model.register()
            if self.job.start_step is None:
                self.store.update(self.job_id, start_step=await model.get_step())
            try:
                if spec.method == "reinforcement":
                    await self._reinforce(model)
                else:
                    await self._train_offline(model)
            except Stopped:
                assert self.stop.requested is not None
                return "cancelled" if self.stop.requested == "cancel" else "paused"
        return "succeeded"

    # ------------------------------------------------------------------------------ reinforcement

    async def _reinforce(self, model: art.TrainableModel) -> None:
        spec = self.spec
        assert self.reward is not None
        rows = parse_prompt_rows(self.store.rows(self.job_id, "train"))
        validation = parse_prompt_rows(self.store.rows(self.job_id, "validation")) if spec.validation_rows else []
        first = self.job.iteration
        if first == 0 and validation:
            await self._evaluate(model, validation, iteration=0, model_name=f"{spec.target_model}@{self.job.start_step}")
        for iteration in range(first, spec.iterations):
            self.stop.check()
            started = time.monotonic()
            settings = spec.iteration_settings(iteration)
            batch = batch_rows(rows, iteration=iteration, batch_size=spec.batch_size, seed=spec.seed)
            groups = await self.stop.interruptible(self._sample_groups(model, rows, batch, iteration, settings))
            rollout_seconds = time.monotonic() - started
            rewards = [t.reward or 0.0 for g in groups for t in g.trajectories]
            errors = [t.metadata["reward_error"] for g in groups for t in g.trajectories
                      if t.metadata.get("reward_error")]
            self._report_reward_errors(errors, iteration)
            if rewards and len(errors) == len(rewards):
                raise JobFailed(f"every reward of iteration {iteration + 1} failed; the first: {errors[0]}",
                                code="reward_failed")
            metrics: dict[str, Any] = {
                "step": iteration + 1, "iteration": iteration + 1, "total_iterations": spec.iterations,
                "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
                "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                "reward_errors": len(errors), "rollouts": len(rewards), "rollout_seconds": round(rollout_seconds, 3),
                "temperature": settings.temperature, "group_size": settings.group_size,
                "learning_rate": settings.learning_rate, **self._group_metrics(groups)}
            options: dict[str, Any] = {"learning_rate": settings.learning_rate,
                                       "pass_threshold": self._pass_threshold(), **spec.remedies.train_options()}
            if spec.remedies.entropy_control is not None:
                options["entropy_coef"] = metrics["entropy_coef"] = self._controlled_entropy_coef()
            if spec.remedies.guide_field is not None:
                guided = await self.stop.interruptible(self._guide(groups, rows, iteration))
                groups, metrics["groups_guided"] = guided.groups, guided.guided
                metrics["references_refused"] = len(guided.refused)
            informative = [g for g in groups if _has_signal(g)]
            checkpoint: str | None = None
            if informative:
                result = await self._train(partial(model.train, informative, progress=False, **options))
                checkpoint = result.model
                metrics |= {"loss": result.metrics[-1].loss if result.metrics else 0.0, "model_step": result.step,
                            "trained_tokens": result.start.trainable_tokens if result.start else 0,
                            "groups_trained": len(informative), **_step_metrics(result)}
            else:
                metrics |= {"loss": 0.0, "groups_trained": 0}
                self.event(f"iteration {iteration + 1}: every group's rewards were equal, so there is nothing to "
                           "learn from it; no step was trained", level="warn")
            metrics["seconds"] = round(time.monotonic() - started, 3)
            last = iteration + 1 == spec.iterations
            due = spec.eval.interval is not None and (iteration + 1) % spec.eval.interval == 0
            if validation and (last or due):
                metrics |= await self._evaluate(model, validation, iteration=iteration + 1,
                                                model_name=checkpoint or spec.target_model)
            self._commit_iteration(iteration, metrics, checkpoint)

    async def _sample_groups(self, model: art.TrainableModel, rows: list[PromptRow], batch: list[PromptRow],
                             iteration: int, settings: IterationSettings) -> list[art.TrajectoryGroup]:
        """The iteration's groups: one per row of `batch`; with dynamic sampling, more rows (`resample_rows`)
        until enough groups' rewards differ or the bound on groups examined is reached."""
        groups = await self._rollouts(model, batch, settings)
        dynamic = self.spec.remedies.dynamic_sampling
        if dynamic is None:
            return groups
        wanted = dynamic.signal_groups_wanted(len(batch))
        bound = dynamic.max_groups_examined(len(batch))
        drawn = 0
        while (missing := wanted - sum(map(_has_signal, groups))) > 0 and len(groups) < bound:
            extra = resample_rows(rows, iteration=iteration, start=drawn, count=min(missing, bound - len(groups)),
                                  seed=self.spec.seed)
            drawn += len(extra)
            groups += await self._rollouts(model, extra, settings)
        return groups

    async def _guide(self, groups: list[art.TrajectoryGroup], rows: list[PromptRow], iteration: int) -> Guided:
        """The groups, each whose rollouts all failed with its row's reference answer (`guidance.py`)."""
        assert self.reward is not None and self.spec.remedies.guide_field is not None
        guided = await guide_groups(groups, {row.line: row for row in rows}, self.spec.remedies.guide_field,
                                    self.reward, self._pass_threshold())
        self._warn_first("guide", [f"iteration {iteration + 1}: {why}" for why in guided.refused])
        return guided

    def _controlled_entropy_coef(self) -> float:
        """The entropy bonus of the next iteration: `entropy_coef` (0 when unset) at first, then moved by the
        entropy control after each iteration, from the last one's coefficient and sampling entropy (the job's
        last metrics, so a resumed job goes on from where it stopped)."""
        remedies = self.spec.remedies
        assert remedies.entropy_control is not None
        last = self.job.last_metrics
        if "entropy_coef" not in last:
            return remedies.entropy_coef or 0.0
        return remedies.entropy_control.next_coef(last["entropy_coef"], last.get("sampling_entropy"))

    def _pass_threshold(self) -> float:
        assert self.reward is not None
        threshold = self.reward.reward.pass_threshold
        return self.spec.eval.pass_threshold if threshold is None else threshold

    def _group_metrics(self, groups: list[art.TrajectoryGroup]) -> dict[str, float | int]:
        """Why an iteration may carry little signal: the groups without reward variance and the rows' pass
        rates (all-wrong / mixed / all-right) over every group rolled out."""
        stats = group_statistics([[t.reward for t in g.trajectories] for g in groups], self._pass_threshold())
        counts: dict[str, float | int] = {
            "groups": len(groups), "zero_variance_groups": stats.zero_variance, "groups_all_wrong": stats.all_wrong,
            "groups_mixed": stats.mixed, "groups_all_right": stats.all_right}
        optional = {"zero_variance_fraction": stats.zero_variance_fraction, "pass_rate": stats.pass_rate}
        return counts | {name: value for name, value in optional.items() if value is not None}

    async def _rollouts(self, model: art.TrainableModel, batch: list[PromptRow],
                        settings: IterationSettings) -> list[art.TrajectoryGroup]:
        spec = self.spec
        reward = self.reward
        assert reward is not None

        async def rollout(row: PromptRow) -> art.Trajectory:
            async with model.trajectory() as t:
                client = t.async_openai_client()
                episode = await run_episode(client, t.model, row, reward, spec.rollout,
                                            temperature=settings.temperature)
                assert episode.score is not None
                t.reward = episode.score.value
                t.metadata["reward_error"] = episode.score.error
                t.metadata[ROW_METADATA] = row.line
            return t

        groups = (art.TrajectoryGroup(rollout(row) for _ in range(settings.group_size)) for row in batch)
        try:
            return await art.gather_trajectory_groups(groups, max_exceptions=ROLLOUT_FAILURE_BUDGET, progress=False)
        except art.ArtlikeError as error:
            raise JobFailed(f"rollouts failed: {error}", code="rollout_failed") from error
        except openai.OpenAIError as error:
            raise JobFailed(f"rollouts failed: {type(error).__name__}: {error}", code="rollout_failed") from error

    async def _train(self, start: Callable[[], art.TrainStream]) -> art.TrainResult:
        """One /_train_model call; a model busy with someone else's training is waited for."""
        for _ in range(TRAIN_CONFLICT_RETRIES):
            try:
                return await start()
            except art.ConflictError:
                self.stop.check()
                await asyncio.sleep(TRAIN_CONFLICT_RETRY_S)
            except (art.APIError, art.TrainingError, art.APIConnectionError) as error:
                raise JobFailed(f"training failed: {error}", code="training_failed") from error
        raise JobFailed("the model stayed busy with other training for too long", code="training_busy")

    def _report_reward_errors(self, errors: list[str], iteration: int) -> None:
        self._warn_first("reward", [f"reward error in iteration {iteration + 1} (the sample scored 0): {error}"
                                    for error in errors])

    def _warn_first(self, kind: str, messages: list[str]) -> None:
        """`warn` events for the job's first MAX_REWARD_ERROR_EVENTS messages of this kind; later ones are
        counted in the iteration's metrics, not repeated."""
        for message in messages[:max(0, MAX_REWARD_ERROR_EVENTS - self._warned[kind])]:
            self._warned[kind] += 1
            self.event(message, level="warn")

    def _commit_iteration(self, iteration: int, metrics: dict[str, Any], checkpoint: str | None) -> None:
        spec = self.spec
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if checkpoint is not None:
            self.store.add_checkpoint(self.job_id, iteration + 1, checkpoint,
                                      numeric | {"train_loss": numeric.get("loss", 0.0)})
        job = self.job
        self.store.update(self.job_id, iteration=iteration + 1,
                          trained_tokens=job.trained_tokens + int(metrics.get("trained_tokens", 0)),
                          last_metrics=numeric)
        self.event(f"iteration {iteration + 1}/{spec.iterations}: reward {metrics['reward_mean']:.3f}"
                   + (f", loss {metrics['loss']:.4f}" if checkpoint else ", no step"), metrics=metrics)

    # ---------------------------------------------------------------------------------- evaluation

    async def _evaluate(self, model: art.TrainableModel, rows: list[PromptRow], *, iteration: int,
                        model_name: str) -> dict[str, float]:
        """Mean reward and pass rate of `model_name` on the validation rows (plain API: not recorded)."""
        spec = self.spec
        reward = self.reward
        assert reward is not None
        async with openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=self.server.api_key or "none",
                                      max_retries=3) as client:
            episodes = await self.stop.interruptible(asyncio.gather(*(
                run_episode(client, model_name, row, reward, spec.rollout, temperature=spec.eval.temperature)
                for row in rows for _ in range(spec.eval.samples))))
        scores = [e.score.value if e.score else 0.0 for e in episodes]
        threshold = reward.reward.pass_threshold if reward.reward.pass_threshold is not None \
            else spec.eval.pass_threshold
        result = {"valid_reward_mean": statistics.fmean(scores),
                  "valid_pass_rate": sum(s >= threshold for s in scores) / len(scores)}
        self.event(f"validation at iteration {iteration}: reward {result['valid_reward_mean']:.3f}, "
                   f"pass rate {result['valid_pass_rate']:.2f} ({len(scores)} samples)",
                   metrics={"iteration": iteration, "total_iterations": spec.iterations, "eval": True,
                            "valid_samples": len(scores)} | result)
        return result

    # ------------------------------------------------------------------------------ supervised, dpo

    async def _train_offline(self, model: art.TrainableModel) -> None:
        spec = self.spec
        if self.job.iteration >= 1:
            return  # its one step was committed before a restart
        data = self.store.rows(self.job_id, "train")
        stream: art.TrainStream
        if spec.method == "supervised":
            examples = parse_chat_examples(data)
            stream = model.train_sft(examples, epochs=spec.iterations,  # {"messages", "tools"}: tools rendered too
                                     learning_rate=spec.learning_rate, progress=False)
        else:
            pairs = parse_preference_rows(data)
            stream = model.train_dpo(pairs, epochs=spec.iterations, learning_rate=spec.learning_rate,
                                     progress=False, **_dpo_options(spec.hyperparameters))
        total, tokens = 0, 0
        last: dict[str, float] = {}
        done: art.DoneEvent | None = None
        try:
            async for event in stream:
                if isinstance(event, art.StartEvent):
                    total, tokens = event.num_gradient_steps, event.trainable_tokens
                elif isinstance(event, art.StepEvent):
                    last = {"step": event.gradient_step, "loss": event.loss, "train_loss": event.loss, **event.metrics}
                    self.event(f"step {event.gradient_step}/{event.num_gradient_steps}: loss {event.loss:.4f}",
                               metrics={"iteration": event.gradient_step, "total_iterations": total} | last)
                elif isinstance(event, art.DoneEvent):
                    done = event
        except (art.APIError, art.TrainingError, art.APIConnectionError) as error:
            raise JobFailed(f"training failed: {error}", code="training_failed") from error
        if done is None:
            raise JobFailed("the training stream ended without a result", code="training_failed")
        self.store.add_checkpoint(self.job_id, 1, done.model, last)
        self.store.update(self.job_id, iteration=1, last_metrics=last, trained_tokens=tokens)


def _dpo_options(hyperparameters: dict[str, Any]) -> dict[str, Any]:
    beta = hyperparameters.get("beta")
    return {"beta": float(beta)} if isinstance(beta, int | float) and math.isfinite(beta) else {}
