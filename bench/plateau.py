"""What lifts GRPO past its plateau on the demo task: each of `art.PipelineTrainer`'s remedies alone and
combined, the same wall-clock budget and the same seeds, against the SFT ceiling (bench/ceiling.py).

Starts its own `artlike serve` (the default model, or `--model DIR`). For each named config it registers a
fresh model (the demo's LoRA budget), evaluates held-out problems (the demo's; greedy, and one sample at
temperature 1) and greedy decoding over the whole task, then trains with `art.PipelineTrainer` on the demo's
training pool (the demo's rollout, reward and group shape) and evaluates again at each checkpoint
(`--checkpoints`, minutes of training; evaluations are not counted). Configs (`--configs` picks some, run in
the order given with the baseline first): baseline (the demo's settings, GRPO's defaults), dynamic_sampling,
curriculum, entropy_bonus, clip_higher (`epsilon_high` 0.4 instead of 0.28), clip_higher_entropy (the wider
clip with a stronger entropy bonus), temperature (a schedule from hot to 1), group_size (a growing group),
lr_schedule (a cosine over the run's steps), higher_lr (a constant 2.5x the demo's learning rate), guidance
(the known answer joins a group whose rollouts all failed), retry_failed (such a group is rolled out again at
temperature 1.5, and joined by that retry where one of its rollouts passed), clip_cov (Clip-Cov on 2% of a
step's tokens), w_reinforce (positive advantages weigh a tenth), entropy_control (an entropy bonus that rises
while the sampling entropy is under 0.2 nats a token and falls while over), entropy_control_strong (the same
control with steps of 0.01 up to 0.4 instead of 0.005 up to 0.1), entropy_control_answer (the strong control
holding 0.1 nats a token, with the rollout's sampling stopped at the answer's closing tag), kl_penalty (a k3
KL penalty to the base model weighed 0.1), combined (the schedules, dynamic sampling, the curriculum, the
entropy bonus and the wider clip). Schedules span `--schedule-steps` steps (default: the steps the run's
baseline took by its last checkpoint). Sampling is not seeded, so two runs of a config differ: `--repeats N`
trains every config N times (rounds `name`, `name-2`, ...), each round read against its own baseline, to show
the spread between runs next to the differences between configs.

    python -m bench.plateau [--checkpoints 15 30] [--configs baseline combined] [--repeats 1] [--model DIR]
                            [--output FILE [--resume]]

Prints the table bench/README.md shows (against the SFT ceiling measured on this kind of machine, else
bench/results/ceiling.json, when present) and writes `bench/results/plateau.json` (`--output` to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artlike_server.engine.launch import detect_device
from artlike_server.launcher import ServerProcess

import artlike as art
from bench.arithmetic import LORA_RANK, greedy_and_sampled, held_out, server_args, training_pool
from bench.ceiling import RESULTS as CEILING
from bench.machine import machine, matmul_speed, same_kind, same_speed
from bench.tables import config_of
from bench.tables import plateau as plateau_table
from examples.arithmetic.demo import MAX_TOKENS, reference
from examples.arithmetic.task import Problem, reward

RESULTS = Path(__file__).resolve().parent / "results" / "plateau.json"
KEY = "bench"
GROUP_SIZE, GROUPS_PER_STEP, LEARNING_RATE = 8, 8, 2e-4  # the demo's


@dataclass(frozen=True)
class Remedy:
    """A named config: `PipelineTrainer` keywords and training options on top of the baseline's, and stop
    strings for the rollout's sampling (none: it ends at the end-of-turn token or `max_tokens`)."""

    name: str
    pipeline: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()


def remedies(schedule_steps: int) -> list[Remedy]:
    dynamic = {"dynamic_sampling": art.DynamicSampling(max_resample_factor=3.0)}
    curriculum = {"curriculum": art.PassRateCurriculum(pass_threshold=1.0)}
    entropy = {"entropy_coef": 3e-3}
    temperature = {"temperature": art.Schedule(start=1.3, end=1.0, steps=schedule_steps)}
    group_size = {"group_size_schedule": art.Schedule(start=GROUP_SIZE, end=2 * GROUP_SIZE, steps=schedule_steps)}
    lr = {"learning_rate_schedule": art.Schedule(start=LEARNING_RATE, end=LEARNING_RATE / 4, steps=schedule_steps,
                                                 shape="cosine", warmup_steps=3)}
    return [
        Remedy("baseline"),
        Remedy("dynamic_sampling", dynamic),
        Remedy("curriculum", curriculum),
        Remedy("entropy_bonus", train=entropy),
        Remedy("clip_higher", train={"epsilon_high": 0.4}),
        # the wider clip with an entropy bonus strong enough to weigh against the policy gradient
        Remedy("clip_higher_entropy", train={"epsilon_high": 0.4, "entropy_coef": 1e-2}),
        Remedy("temperature", temperature),
        Remedy("group_size", group_size),
        Remedy("lr_schedule", lr),
        # a constant learning rate 2.5x the demo's: more movement per step when most groups carry no signal
        Remedy("higher_lr", train={"learning_rate": 2.5 * LEARNING_RATE}),
        Remedy("guidance", {"guide": reference}),
        # exploration without the answers: an all-wrong group rolled out again at temperature 1.5
        Remedy("retry_failed", {"retry_failed": art.RetryFailedGroups(temperature=1.5)}),
        # Clip-Cov: a few tokens whose update would sharpen the policy most leave the loss (2% of a step's)
        Remedy("clip_cov", train={"clip_cov_fraction": 0.02}),
        # W-REINFORCE: the right samples' advantages weigh a tenth, the wrong ones' in full
        Remedy("w_reinforce", train={"positive_advantage_weight": 0.1}),
        # adaptive entropy control: the bonus moves by 0.005 a step towards holding 0.2 nats a token
        Remedy("entropy_control", {"entropy_control": art.EntropyControl(target=0.2)}),
        # the same control, free to go four times as high and twice as fast
        Remedy("entropy_control_strong",
               {"entropy_control": art.EntropyControl(target=0.2, coef_step=0.01, max_coef=0.4)}),
        # the same control holding 0.1 nats a token, with sampling ended at the answer's closing tag: every
        # sampled token is one the reward reads, so the entropy it holds is the answer's
        Remedy("entropy_control_answer",
               {"entropy_control": art.EntropyControl(target=0.1, coef_step=0.01, max_coef=0.4)},
               stop=("</answer>",)),
        # a k3 KL penalty to the base model, weighed 0.1: it pulls every sampled token's probability back
        # towards the base's, and its gradient fades far more slowly than an entropy bonus's as the policy
        # grows sure of a token
        Remedy("kl_penalty", train={"kl_beta": 0.1}),
        Remedy("combined", {**dynamic, **curriculum, **temperature, **group_size, **lr},
               {**entropy, "epsilon_high": 0.4}),
    ]


def rollout_of(model: art.TrainableModel, stop: tuple[str, ...] = ()) -> Callable[[Problem], Any]:
    # vLLM leaves a stop string out of the text unless asked: the reward reads the closing tag
    stopping: dict[str, Any] = (
        {"stop": list(stop), "extra_body": {"include_stop_str_in_output": True}} if stop else {})

    async def rollout(problem: Problem) -> art.Trajectory:
        async with model.trajectory() as t:
            client = t.async_openai_client()
            completion = await client.chat.completions.create(
                model=model.name, messages=problem.messages(), max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                temperature=art.rollout_temperature(1.0), **stopping)
            t.reward, t.metrics = reward(problem, completion.choices[0].message.content or "")
        return t
    return rollout


def run_keys(configs: list[str], repeats: int) -> list[str]:
    """The runs a bench run makes, in order: every config once, then all of them again for each further round,
    so that a run stopped midway holds whole rounds.

    >>> run_keys(["baseline", "clip_higher"], 2)
    ['baseline', 'clip_higher', 'baseline-2', 'clip_higher-2']
    """
    return [name if round_ == 1 else f"{name}-{round_}" for round_ in range(1, repeats + 1) for name in configs]


def run_order(configs: list[str]) -> list[str]:
    """The configs in the order given, but the baseline first (the schedules of the others span its steps).

    >>> run_order(["clip_cov", "higher_lr", "baseline", "clip_cov"])
    ['baseline', 'clip_cov', 'higher_lr']
    """
    return sorted(dict.fromkeys(configs), key=lambda name: name != "baseline")


async def train_one(remedy: Remedy, key: str, args: argparse.Namespace, base_url: str, base_model: str,
                    pool: list[Problem], eval_set: list[Problem], state_dir: Path) -> dict[str, Any]:
    model = art.TrainableModel(name=f"plateau-{key.replace('_', '-')}", base_model=base_model,
                               server=base_url, api_key=KEY, lora=art.LoraConfig(rank=LORA_RANK, alpha=2 * LORA_RANK))
    await model.register()
    # The curriculum draws from the pool; otherwise the pool is walked once, in the same order for every config.
    scenarios = pool if "curriculum" in remedy.pipeline else pool * 4
    trainer = art.PipelineTrainer(
        model, rollout_of(model, remedy.stop), scenarios, group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP,
        max_steps_off_policy=args.max_steps_off_policy, state_path=state_dir / f"{key}.json", progress=False,
        **{"learning_rate": LEARNING_RATE, **remedy.train}, **remedy.pipeline)
    before = await greedy_and_sampled(base_url, KEY, model.name, eval_set)
    print(f"{key}: before: greedy {before['greedy']:.1%}, T=1 {before['sampled']:.1%}, "
          f"greedy over the whole task {before['greedy_task']:.1%}")
    checkpoints: list[dict[str, Any]] = []
    steps: list[art.PipelineStep] = []
    trained_seconds = 0.0
    for minutes in args.checkpoints:
        began = time.perf_counter()
        result = await trainer.run(max_seconds=max(0.0, minutes * 60 - trained_seconds))
        trained_seconds += time.perf_counter() - began
        steps = result.steps  # every run's reports (the state file carries them over)
        scores = await greedy_and_sampled(base_url, KEY, model.name, eval_set)
        checkpoints.append({"minutes": minutes, "train_seconds": round(trained_seconds, 1), "steps": len(steps),
                            "groups_trained": sum(s.groups for s in steps),
                            "zero_variance_groups": sum(s.zero_variance_groups for s in steps), **scores})
        print(f"{key}: {minutes:g} min: {len(steps)} steps, greedy {scores['greedy']:.1%}, "
              f"T=1 {scores['sampled']:.1%}, greedy over the whole task {scores['greedy_task']:.1%}")
    await model.aclose()
    return {"before": before, "checkpoints": checkpoints,
            "train_config": trainer.config.model_dump(mode="json"),  # every option, defaults included
            "steps": [{"step": s.step, "reward_mean": s.reward_mean, "correct": s.metrics.get("correct"),
                       "zero_variance_groups": s.zero_variance_groups, "groups": s.groups,
                       "groups_all_wrong": s.groups_all_wrong, "groups_all_right": s.groups_all_right,
                       "groups_guided": s.groups_guided, "groups_retried": s.groups_retried,
                       "groups_rescued": s.groups_rescued,
                       "sampling_entropy": s.sampling_entropy, "response_tokens_mean": s.response_tokens_mean,
                       "loss": s.loss, "clip_fraction": s.clip_fraction, "logprob_mismatch": s.logprob_mismatch,
                       "clip_cov_fraction": s.objective_metrics.get("clip_cov_fraction"),
                       "entropy": s.entropy, "entropy_coef": s.entropy_coef, "kl_to_base": s.kl_to_base,
                       "rollout_seconds": round(s.rollout_seconds, 2),
                       "train_seconds": round(s.train_seconds, 2), "step_seconds": round(s.step_seconds, 2)}
                      for s in steps]}


def ceiling(results: Path = CEILING.parent, model: str | None = None) -> dict[str, Any] | None:
    """The SFT ceiling to read the rows against, among the `ceiling*.json` of the same `model` (`--model`; None:
    the default): one measured on a machine described as this one (the ceiling depends on the dtype the machine
    trains in), else `ceiling.json`, else none."""
    measured = {path.name: result for path in sorted(results.glob("ceiling*.json"))
                if (result := json.loads(path.read_text())).get("settings", {}).get("model") == model}
    here = [name for name, result in measured.items() if "machine" in result and same_kind(result["machine"], machine())]
    name = here[0] if here else CEILING.name if CEILING.name in measured else None
    return None if name is None else {"file": name, "greedy": float(measured[name]["ceiling_greedy"]),
                                      "greedy_task": measured[name].get("ceiling_greedy_task"),
                                      "machine": measured[name]["machine"]}


def schedule_steps(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> int:
    """The steps a config's schedules span: `--schedule-steps`, else the steps the baseline of this run took by
    its last checkpoint (so that a schedule runs its course within the budget on this machine), else 200."""
    if args.schedule_steps is not None:
        return int(args.schedule_steps)
    baseline = runs.get("baseline")
    return int(baseline["checkpoints"][-1]["steps"]) if baseline and baseline["checkpoints"] else 200


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [r.name for r in remedies(1)]
    unknown = set(args.configs or []) - set(names)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}")
    pool, eval_set = training_pool(args.pool_size), held_out(args.eval_size)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("resume",)}
    speed = matmul_speed()  # before the server starts: nothing else running
    kept = resumed(args.output, settings, speed) if args.resume else {"configs": {}, "runs": {}}
    wanted = run_order(args.configs or names)
    chosen = [key for key in run_keys(wanted, args.repeats) if key not in kept["runs"]]
    settings["configs"] = list(dict.fromkeys(config_of(key) for key in [*kept["runs"], *chosen]))  # all it holds
    runs: dict[str, dict[str, Any]] = dict(kept["runs"])
    configs: dict[str, Any] = dict(kept["configs"])
    top = ceiling(model=args.model)
    report = {"settings": settings, "configs": configs, "ceiling_greedy": top and top["greedy"],
              "ceiling_greedy_task": top and top["greedy_task"],
              "ceiling_file": top and top["file"], "ceiling_machine": top and top["machine"], "runs": runs,
              "machine": machine(), "speed": speed}
    with tempfile.TemporaryDirectory() as data_dir, \
            ServerProcess(Path(data_dir), args=server_args(args.model), api_key=KEY) as server:
        for key in chosen:  # the baseline first, so the schedules of the others can span its steps
            remedy = next(r for r in remedies(schedule_steps(args, runs)) if r.name == config_of(key))
            configs[remedy.name] = {"pipeline": {k: getattr(v, "__name__", None) or repr(v)  # a function: its name
                                                 for k, v in remedy.pipeline.items()},
                                    "train": remedy.train,
                                    **({"stop": list(remedy.stop)} if remedy.stop else {})}
            runs[key] = await train_one(remedy, key, args, server.base_url, server.model_id, pool, eval_set,
                                        Path(data_dir) / "pipeline-state")
            write(args.output, report)  # after every config: a long run stopped midway keeps what it measured
    print(plateau_table(args.output.name)(report))  # the table bench/README.md shows
    return report


COMPARABLE = ("model", "checkpoints", "schedule_steps", "pool_size", "eval_size", "max_steps_off_policy")


def resumed(path: Path, settings: dict[str, Any], speed: float | None = None) -> dict[str, Any]:
    """The configs and runs of an earlier run's result file, to be completed by this one: only when it was
    measured with the same settings on a machine described the same (CPU, cores, instruction sets) and, where
    both were measured, of the same matmul `speed` (within 15%). Its rows compare with the new ones when it is
    the same machine, with nothing else running, as for one run."""
    if not path.exists():
        return {"configs": {}, "runs": {}}
    earlier = json.loads(path.read_text())
    scheduled = any("Schedule(" in repr(config) for config in earlier["configs"].values())
    differs = [k for k in COMPARABLE if earlier["settings"].get(k) != settings[k]
               and (k != "schedule_steps" or scheduled)]  # schedule steps matter only to runs with a schedule
    if differs or not same_kind(earlier["machine"], machine()):
        raise SystemExit(f"{path} was measured {'on another machine' if not differs else f'with other {differs}'}: "
                         "its runs would not compare with this run's; choose another --output")
    if speed is not None and earlier.get("speed") is not None and not same_speed(earlier["speed"], speed):
        raise SystemExit(f"{path} was measured on a machine described as this one but of another speed (matmul "
                         f"{earlier['speed']:g} against {speed:g} GFLOP/s in bfloat16): its runs would "
                         "train other numbers of steps in the budget; choose another --output")
    return {"configs": earlier["configs"], "runs": earlier["runs"]}


def write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=float, nargs="+", default=[15.0, 30.0],
                        help="minutes of training at which to evaluate (the last ends the run)")
    parser.add_argument("--configs", nargs="+", help="the named configs to run (default: all)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every config (sampling is not seeded: the spread between runs)")
    parser.add_argument("--schedule-steps", type=int,
                        help="steps the schedules span (default: the steps this run's baseline took by the last "
                             "checkpoint, so that a schedule runs its course within the budget on this machine)")
    parser.add_argument("--model", help="a Hugging Face model directory to serve and train (default: the embedded "
                                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--pool-size", type=int, default=1024, help="training problems (the demo's seed)")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems (the demo's)")
    parser.add_argument("--max-steps-off-policy", type=int, default=None,
                        help="default: 1 on a GPU, 0 on a CPU (the demo's)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --output (same machine and settings) and run the other configs")
    args = parser.parse_args()
    if sorted(args.checkpoints) != args.checkpoints:
        parser.error("--checkpoints must be increasing")
    if args.max_steps_off_policy is None:
        args.max_steps_off_policy = 1 if detect_device() == "cuda" else 0
    write(args.output, asyncio.run(run(args)))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
