"""Trainer throughput vs this machine's measured matmul peak, and the swap latency, in one run.

    python -m bench.train_throughput [--quick] [--skip-swap]

1. Peak: the best of several 2048³ matmuls on this process's threads, per dtype — the machine's measured
   ceiling, not a datasheet number. The dtype the trainer's "auto" picks (the cached dtype probe,
   `artlike_server.dtype_probe`, as `artlike serve` runs it) goes first; bf16 is skipped where the probe found
   it emulated (orders of magnitude slower than fp32), and the bench records why.
2. Trainer: the real trainer worker (the same subprocess and protocol the server uses) trains fixed batches
   for several optimizer steps (LoRA r=8 on all linear layers); each step reports its trained tokens,
   seconds and decoder positions. Two batches, 8 sequences × 256 tokens each:
   - "random": unrelated sequences, the first 32 tokens a prompt and the rest trained;
   - "grpo": 2 groups × 4 samples, each group's 192-token prompt shared, 64 sampled tokens trained, run
     with `share_prefixes` on (the default: the prompt goes through the decoder once per micro-batch) and off.
   Then one row per objective with the same options (`OBJECTIVE_ROWS`: learning rate, `epochs` = the
   optimizer steps, one step per epoch over the whole batch, the micro-batch budget): grpo, cispo, gspo, is
   (importance_sampling), sft and "grpo+kl" (GRPO with kl_beta = 0.05, which also runs the reference policy)
   on the "grpo" batch, and dpo on the "pairs" batch (the same sequences as 4 chosen/rejected pairs, each
   pair's prompt shared; its work is chosen + rejected + the reference forward). Then the two objectives
   with heads: reward_model on the "pairs" batch (an adapter made with a fresh score head,
   `InitAdapter.reward_head`; Bradley–Terry on the pairs' scores: the decoder only, no LM head), ppo on the
   "grpo" batch (each sequence with a reward, 1 or 0; a value head; once per job the reference and the
   policy forward), and "ppo+rm" (ppo whose job also scores every sequence once with the reward_model row's
   trained step, `Train.reward_model_dir`).
   Model FLOPs count the work the trainer does, from the same plans it uses (`torch_worker.loop.plan_job` for the
   optimizer steps, `plan_step` for each step's micro-batches): per step, 4·N_decoder per decoder position
   (forward 2·N plus the backward's activation gradients 2·N; the frozen base needs no weight gradients; a
   prompt position counts, since its keys and values feed the trained tokens), attention at
   16·layers·d per attended (query, key) pair (forward and backward), and 4·N_head per trained token (the
   LM head runs on those only). A reward model's step runs the decoder over every position of a row (T,
   not T − 1: the score pools the last token's state) and no LM head at all; its score head and PPO's value
   head (d or K·d per position) are left out. Once-per-job passes (no gradient) are forwards over the same
   plan as the trainer runs them, each 2·N_decoder per position, 4·layers·d per attended pair and 2·N_head
   per trained token: the reference pass (grpo+kl, dpo), and PPO's reference plus policy passes (logprobs
   and values); a reward model's scoring (ppo+rm) is 2·N_decoder per token of every whole sequence and
   4·layers·d per pair, without shared prefixes or LM head. Which passes a row runs is asked of its
   objective (`needs_reference`, and a dry run of its `prepare`). Their time is in the job's first step, so
   rows with such a pass average over every step, the others leave the first (warm-up) step out. The
   fraction of peak is achieved FLOP/s ÷ measured peak of the same dtype. Trained tokens are what the
   steps report, except for reward_model, whose steps count sequences: there they are the answers' tokens
   (DPO's trained tokens on the same batch). "Sharing speed-up" is trained tokens/s with shared prefixes
   over without, same batch.
3. Swap: a real server trains one step; we time from the last `step` line to the first token served by
   the new step (`done` includes writing the adapter, loading it into vLLM and moving the alias).
Targets on CPU: ≥ 35% of the measured bf16 matmul peak during the step (fp32 peak where bf16 is emulated),
≤ 0.5 s from last step to serving. `--quick` (a smoke run): 2 optimizer steps per row, and only the dtype
the trainer's "auto" picks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import httpx
import orjson
import torch
from artlike_server.default_model import ensure_default_model
from artlike_server.dtype_choice import choose_dtypes
from artlike_server.dtype_probe import probe
from artlike_server.hardware import cpu_has_native_bf16
from artlike_server.launcher import ServerProcess
from artlike_server.torch_worker.loop import plan_job, plan_step
from artlike_server.torch_worker.objectives import JobPasses, Objective, build_objective
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.training.trainer_client import TrainerProcess
from transformers import AutoConfig

from artlike.types import (
    CISPOConfig,
    DPOConfig,
    GRPOConfig,
    GSPOConfig,
    ImportanceSamplingConfig,
    LoraConfig,
    PPOConfig,
    RewardHeadConfig,
    RewardModelConfig,
    SFTConfig,
    TrainConfig,
)
from bench.machine import machine

SEQUENCES, LENGTH = 8, 256
RANDOM_PROMPT = 32
GRPO_GROUPS, GRPO_PROMPT = 2, 192


class ObjectiveRow(NamedTuple):
    batch: str  # "grpo" or "pairs"
    make: Callable[[dict[str, Any]], TrainConfig]  # the config from the shared options
    reward_head: RewardHeadConfig | None = None  # a reward model: its adapter is made with this score head
    scored_by: str | None = None  # the row whose trained step (a reward model) scores this job's sequences


# The per-objective rows with the same shared options (learning rate, epochs, micro-batch budget): a row is
# one line. DPO and the reward model train on the "pairs" batch: the grpo batch's shape as 4 preference pairs.
OBJECTIVE_ROWS: dict[str, ObjectiveRow] = {
    "grpo": ObjectiveRow("grpo", lambda o: GRPOConfig(**o)),
    "cispo": ObjectiveRow("grpo", lambda o: CISPOConfig(**o)),
    "gspo": ObjectiveRow("grpo", lambda o: GSPOConfig(**o)),
    "is": ObjectiveRow("grpo", lambda o: ImportanceSamplingConfig(**o)),
    "sft": ObjectiveRow("grpo", lambda o: SFTConfig(**o)),
    "grpo+kl": ObjectiveRow("grpo", lambda o: GRPOConfig(**o, kl_beta=0.05)),  # + the reference forward, once
    "dpo": ObjectiveRow("pairs", lambda o: DPOConfig(**o)),  # chosen + rejected, and the reference forward
    "reward_model": ObjectiveRow("pairs", lambda o: RewardModelConfig(**o), reward_head=RewardHeadConfig()),
    "ppo": ObjectiveRow("grpo", lambda o: PPOConfig(**o)),  # value head; reference + policy forwards, once
    "ppo+rm": ObjectiveRow("grpo", lambda o: PPOConfig(**o, reward_model="bench-reward_model"),
                           scored_by="reward_model"),  # + the reward model's scoring forward, once
}


def matmul_peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 8) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)  # warm-up: first call picks kernels
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


@dataclass(frozen=True)
class ModelDims:
    decoder_params: int
    head_params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model_dir: Path) -> ModelDims:
        config = AutoConfig.from_pretrained(model_dir)
        d, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
        kv = config.num_key_value_heads * (d // config.num_attention_heads)
        decoder = layers * (d * d * 2 + d * kv * 2 + 3 * d * ffn)  # q,o + k,v + gate,up,down
        return cls(decoder, config.vocab_size * d, layers, d)  # lm_head tied to the embeddings


@dataclass(frozen=True)
class PlanWork:
    """What some micro-batches run through the model."""

    positions: int  # decoder positions
    pairs: int  # attended (query, key) pairs
    trained: int  # trained tokens: the LM head's positions (0 where no LM head runs)


def plan_work(sequences: list[TrainSequence], config: TrainConfig, *, share_prefixes: bool, full_rows: bool = False,
              lm_head: bool = True) -> PlanWork:
    """Positions, attention pairs and trained tokens of one pass over `sequences` as the trainer plans it
    (`plan_step`); padding is not counted. `full_rows`: the decoder runs over a row's last token too (a
    reward model's `decoder_states(last=True)`); `lm_head` off: no trained tokens (a reward model)."""
    positions = pairs = trained = 0
    for plan in plan_step(sequences, config.micro_batch_tokens, share_prefixes=share_prefixes):
        for prefix, _ in plan.families:
            positions += prefix
            pairs += prefix * (prefix + 1) // 2
        for index, prefix in zip(plan.members, plan.prefixes(), strict=True):
            own = sequences[index].num_tokens - prefix - (0 if full_rows else 1)  # else the last is only a target
            positions += own
            pairs += own * prefix + own * (own + 1) // 2
            trained += sequences[index].num_trainable_tokens if lm_head else 0
    return PlanWork(positions, pairs, trained)


def score_work(sequences: list[TrainSequence]) -> PlanWork:
    """A reward model's scoring of whole sequences (`loop.score_sequences`): every token, no shared prefix,
    no LM head; padding is not counted."""
    lengths = [s.num_tokens for s in sequences]
    return PlanWork(sum(lengths), sum(n * (n + 1) // 2 for n in lengths), 0)


def flops(dims: ModelDims, work: PlanWork, *, backward: bool) -> float:
    """Model FLOPs of `work`: forward and backward (activation gradients only), or forward only."""
    attention = dims.layers * dims.hidden * work.pairs
    if backward:
        return 4 * dims.decoder_params * work.positions + 16 * attention + 4 * dims.head_params * work.trained
    return 2 * dims.decoder_params * work.positions + 4 * attention + 2 * dims.head_params * work.trained


JOB_PASSES = ("reference", "policy", "reward")


def job_passes(objective: Objective, batch: list[TrainSequence], *, scored: bool) -> frozenset[str]:
    """The once-per-job passes the trainer runs for `objective` on `batch`: "reference" (its logprobs, the
    adapter disabled), "policy" (its logprobs and values now), "reward" (the reward model's scores; only
    when the job names a reward model). Asked of the objective itself: `needs_reference`, and its `prepare`
    run on placeholder outputs while recording what it asks for (the loop runs each pass at most once)."""
    asked = {"reference"} if objective.needs_reference else set()

    def zeros() -> list[torch.Tensor]:
        return [torch.zeros(max(0, s.num_tokens - 1)) for s in batch]

    def reference() -> list[torch.Tensor]:
        asked.add("reference")
        return zeros()

    def policy() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        asked.add("policy")
        return zeros(), zeros()

    def reward() -> list[float]:
        asked.add("reward")
        return [0.0] * len(batch)

    objective.prepare(JobPasses(sequences=batch, state={}, reference_logprobs=reference, policy_outputs=policy,
                                reward_scores=reward if scored else None))  # fmt: skip
    return frozenset(asked)


def random_batch(vocab: int, seed: int = 0) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(SEQUENCES):
        ids = torch.randint(100, vocab, (LENGTH,), generator=generator).tolist()
        batch.append(_sequence(ids, RANDOM_PROMPT, i))
    return batch


def grpo_batch(vocab: int, seed: int = 0) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for group in range(GRPO_GROUPS):
        prompt = torch.randint(100, vocab, (GRPO_PROMPT,), generator=generator).tolist()
        for sample in range(SEQUENCES // GRPO_GROUPS):
            sampled = torch.randint(100, vocab, (LENGTH - GRPO_PROMPT,), generator=generator).tolist()
            batch.append(_sequence(prompt + sampled, GRPO_PROMPT, sample, group))
    return batch


def pairs_batch(vocab: int, seed: int = 0) -> list[TrainSequence]:
    """The grpo batch's shape as DPO pairs: each pair's two answers share their prompt."""
    batch = grpo_batch(vocab, seed)
    for index, sequence in enumerate(batch):
        sequence.group_index, sequence.preference = index // 2, 1 if index % 2 == 0 else -1
    return batch


def _sequence(ids: list[int], prompt: int, index: int, group: int = 0) -> TrainSequence:
    trainable = [j >= prompt for j in range(len(ids))]
    return TrainSequence(
        token_ids=ids, trainable=trainable,
        behaviour_logprobs=[float("nan") if t else 0.0 for t in trainable],  # unknown: on-policy ratio 1
        advantage=1.0 if index % 2 == 0 else -1.0, group_index=group,
        reward=1.0 if index % 2 == 0 else 0.0)  # fmt: skip  # reward: PPO's (the other objectives ignore it)


@dataclass(frozen=True)
class Workload:
    """One row of the table: a batch trained with one config."""

    batch_kind: str  # "random", "grpo" or "pairs"
    objective: str  # the row's objective label ("grpo+kl": GRPO with the KL term)
    batch: list[TrainSequence]
    config: TrainConfig
    reward_head: RewardHeadConfig | None = None  # a reward model's adapter (`InitAdapter.reward_head`)
    scored_by: str | None = None  # the row whose trained step scores this job (`Train.reward_model_dir`)
    passes: frozenset[str] = field(init=False)  # the once-per-job passes (`job_passes`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passes", job_passes(self.build(), self.batch, scored=self.scored_by is not None))

    def build(self) -> Objective:
        return build_objective(self.config, reward_head=self.reward_head)

    def steps(self) -> list[list[TrainSequence]]:
        """Each optimizer step's sequences, as the trainer plans the job."""
        return [[self.batch[i] for i in indices] for indices in plan_job(self.batch, self.config)]

    def step_work(self, sequences: list[TrainSequence]) -> PlanWork:
        objective = self.build()
        return plan_work(sequences, self.config, share_prefixes=self.config.share_prefixes and objective.shares_prefixes,
                         full_rows="reward" in objective.heads, lm_head=objective.needs_logprobs)  # fmt: skip

    def trained_tokens(self, event: dict[str, Any], sequences: list[TrainSequence]) -> int:
        """A step's trained tokens, as its event reports them (a reward model's: its answers' tokens, what DPO
        trains on the same batch)."""
        return int(event["tokens"])

    def job_flops(self, dims: ModelDims) -> float:
        """Model FLOPs of the once-per-job passes (in the first step's time)."""
        total = 0.0
        for name in self.passes:
            if name == "reward":
                total += flops(dims, score_work(self.batch), backward=False)
            else:  # reference and policy: forwards over the plan of the whole batch, LM head on trained tokens
                total += flops(dims, plan_work(self.batch, self.config, share_prefixes=self.config.share_prefixes),
                               backward=False)
        return total


def workloads(vocab: int, steps: int) -> dict[str, Workload]:
    """The rows: the two batches and prefix sharing under GRPO, then every objective on its batch."""
    options: dict[str, Any] = {"learning_rate": 1e-5, "epochs": steps, "gradient_steps_per_epoch": 1,
                               "micro_batch_tokens": SEQUENCES * LENGTH}  # fmt: skip
    grpo = GRPOConfig(**options)
    rows = {
        "random": Workload("random", "grpo", random_batch(vocab), grpo),
        "grpo": Workload("grpo", "grpo", grpo_batch(vocab), grpo),
        "grpo-unshared": Workload("grpo", "grpo", grpo_batch(vocab), grpo.model_copy(update={"share_prefixes": False})),
    }
    batches = {"grpo": grpo_batch, "pairs": pairs_batch}
    for objective, row in OBJECTIVE_ROWS.items():
        if objective != "grpo":  # the "grpo" row above is that objective on that batch
            assert row.scored_by is None or row.scored_by in rows, f"{objective}: its reward model row runs first"
            rows[objective] = Workload(row.batch, objective, batches[row.batch](vocab), row.make(options),
                                       reward_head=row.reward_head, scored_by=row.scored_by)
    return rows


async def trainer_throughput(model_dir: Path, dtype: str, rows: dict[str, Workload], work: Path, *,
                             own_cores: bool = True, attention: Literal["auto", "sdpa", "eager"] = "auto",
                             ) -> dict[str, dict[str, Any]]:
    """Train each row on one trainer worker (one base model load); step events per row. `own_cores`: the
    worker's threads spin-wait as on cores of its own (nothing else runs here), else sleep at once as beside
    an engine; `attention`: the worker's attention implementation."""
    trainer = TrainerProcess(model_dir, dtype=dtype, own_cores=own_cores, attention=attention,
                             log_path=work / f"trainer-{dtype}.log")
    await trainer.start()
    results = {}
    try:
        for name, row in rows.items():
            batch, config = row.batch, row.config
            assert len(row.steps()) == config.epochs * config.gradient_steps_per_epoch
            adapter = work / f"adapter-{dtype}-{name}"
            await trainer.init_adapter(f"bench-{name}", LoraConfig(rank=8), adapter, reward_head=row.reward_head)
            batch_path = work / f"batch-{dtype}-{name}.bin"
            write_batch(batch_path, batch)
            scorer = None if row.scored_by is None else work / f"out-{dtype}-{row.scored_by}"  # its trained step
            step_events = []
            async for event in trainer.train(f"bench-{name}", adapter, work / f"out-{dtype}-{name}", batch_path,
                                             config, reward_model_dir=scorer):
                if isinstance(event, protocol.Step):
                    step_events.append(event.step_event().model_dump())
            # The first step pays one-time costs (allocations, kernels) and is left out, except where it holds
            # the job's once-per-job passes (their time is in the first step): then every step counts.
            first = 0 if row.passes else 1 if len(step_events) > 1 else 0
            measured = step_events[first:]
            tokens = [row.trained_tokens(e, sequences) for e, sequences in zip(step_events, row.steps(), strict=True)]
            results[name] = {
                "steps": step_events,
                "measured_steps": len(measured),
                "first_measured_step": first + 1,
                "job_passes": sorted(row.passes, key=JOB_PASSES.index),
                "tokens_per_s": sum(tokens[first:]) / sum(e["seconds"] for e in measured),
                "seconds_per_step": statistics.fmean(e["seconds"] for e in measured),
                "decoder_positions": measured[0].get("decoder_positions"),  # as the step reports them
            }
    finally:
        await trainer.stop()
    return results


def swap_latency(work: Path) -> dict[str, Any]:
    with ServerProcess(work / "server") as server, httpx.Client(base_url=server.base_url, timeout=600) as http:
        http.post("/v1/trainable_models", json={"name": "swap", "base_model": server.model_id}).raise_for_status()
        groups = []
        for g in range(2):
            trajectories = []
            for i in range(4):
                tid = uuid.uuid4().hex
                http.post(f"/t/{tid}/v1/chat/completions", json={
                    "model": "swap", "messages": [{"role": "user", "content": f"Tell me about topic {g}."}],
                    "max_tokens": 16, "temperature": 1.0}).raise_for_status()
                trajectories.append({"trajectory_id": tid, "reward": float(i)})
            groups.append({"trajectories": trajectories})
        last_step_at = done_at = None
        done: dict[str, Any] = {}
        with http.stream("POST", "/_train_model", json={"model": "swap", "groups": groups}) as response:
            for line in response.iter_lines():
                event = orjson.loads(line)
                if event["type"] == "step":
                    last_step_at = time.perf_counter()
                elif event["type"] == "done":
                    done_at, done = time.perf_counter(), event
        assert last_step_at is not None and done_at is not None, "training did not finish"
        first_token_at = None
        with http.stream("POST", "/v1/chat/completions", json={
                "model": "swap", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    assert chunk["model"] == done["model"], chunk["model"]  # served by the new step
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first_token_at = time.perf_counter()
                        break
        assert first_token_at is not None
        return {"last_step_to_done_s": done_at - last_step_at, "swap_seconds_server": done["swap_seconds"],
                "last_step_to_first_token_s": first_token_at - last_step_at, "new_model": done["model"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-swap", action="store_true")
    parser.add_argument("--output", type=Path, help="default bench/results/train_throughput[_quick].json")
    parser.add_argument("--rows", help="only these rows, comma-separated (default: all)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="only this dtype (default: both, or "
                        "what the trainer's auto picks with --quick)")
    parser.add_argument("--shared-cores", action="store_true",
                        help="the worker's threads sleep at once, as beside an engine on the same cores")
    parser.add_argument("--attention", choices=("auto", "sdpa", "eager"), default="auto",
                        help="the worker's attention implementation (auto: torch_worker/attention.py on a CPU)")
    args = parser.parse_args()
    # A smoke run must not overwrite the full run's results.
    args.output = args.output or Path(f"bench/results/train_throughput{'_quick' if args.quick else ''}.json")
    steps = 2 if args.quick else 4
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = ensure_default_model()
    dims = ModelDims.of(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    work = Path(tempfile.mkdtemp(prefix="artlike-train-bench-"))

    dtype_probe = probe()  # the trainer's "auto", decided as `artlike serve` decides it (cached per machine)
    auto = choose_dtypes({"trainer": "auto"}, "cpu", run_probe=lambda: dtype_probe)["trainer"]
    print(f"trainer dtype auto: {auto.describe()}")
    emulated = bool(dtype_probe.get("bf16_emulated")) if dtype_probe else not cpu_has_native_bf16()
    dtypes = [auto.dtype, *(d for d in ("bfloat16", "float32") if d != auto.dtype)]
    if emulated:
        dtypes.remove("bfloat16")
    if args.dtype:
        if args.dtype not in dtypes:
            parser.error(f"{args.dtype} is emulated on this CPU")
        dtypes = [args.dtype]
    elif args.quick:
        dtypes = dtypes[:1]  # the dtype the trainer's "auto" picks
    # The peak is measured before and after each trainer run and the highest value kept: on a shared VM a
    # single measurement taken in a slow moment inflates the fraction (one run showed "65%" that way).
    peak = {dtype: matmul_peak_gflops(getattr(torch, dtype)) for dtype in dtypes}
    report: dict[str, Any] = {"batch": [SEQUENCES, LENGTH], "peak_gflops": peak, "runs": []}
    report["trainer_dtype_auto"] = {"dtype": auto.dtype, "source": auto.source, "why": auto.why}
    if emulated:
        slow = matmul_peak_gflops(torch.bfloat16, size=512, repeats=2)
        report["bfloat16_skipped"] = (f"bf16 is emulated on this CPU: a 512³ bf16 matmul runs at {slow:.2f} "
                                      f"GFLOP/s; the trainer's auto dtype is float32 here")
        print(f"bf16 skipped: {report['bfloat16_skipped']}")
    print(f"measured matmul peak (2048³, {torch.get_num_threads()} threads): "
          + ", ".join(f"{dtype} {gflops:.0f} GFLOP/s" for dtype, gflops in peak.items()))

    rows = workloads(vocab, steps)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = set(wanted) - set(rows)
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(rows)}")
        for name in list(wanted):  # a row whose job is scored by another row's trained step needs that row
            scorer = rows[name].scored_by
            if scorer is not None and scorer not in wanted:
                wanted.insert(0, scorer)
        rows = {name: row for name, row in rows.items() if name in wanted}
    report["trainer"] = {"own_cores": not args.shared_cores, "attention": args.attention}
    print(f"trainer: {'sleeping at once (shared cores)' if args.shared_cores else 'spin-waiting (own cores)'}, "
          f"attention {args.attention}")
    print(f"\n{'dtype':<9} {'row':<14} {'batch':<7} {'objective':<12} {'trained tok/s':>13} {'s/step':>7} "
          f"{'positions':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for dtype in dtypes:
        results = asyncio.run(trainer_throughput(model_dir, dtype, rows, work, own_cores=not args.shared_cores,
                                                 attention=args.attention))
        peak[dtype] = max(peak[dtype], matmul_peak_gflops(getattr(torch, dtype)))
        for name, run in results.items():
            row = rows[name]
            measured = row.steps()[run["first_measured_step"] - 1 :]
            step_work = [row.step_work(sequences) for sequences in measured]
            job_flops = row.job_flops(dims) if run["first_measured_step"] == 1 else 0.0
            run.update(dtype=dtype, row=name, batch_kind=row.batch_kind, objective=row.objective,
                       share_prefixes=row.config.share_prefixes, kl_beta=getattr(row.config, "kl_beta", 0.0),
                       model_positions=step_work[0].positions, job_pass_flops=job_flops,
                       flops_per_step=(sum(flops(dims, w, backward=True) for w in step_work) + job_flops) / len(measured),
                       peak_gflops=peak[dtype])  # fmt: skip
            run["gflops"] = run["flops_per_step"] / run["seconds_per_step"] / 1e9
            run["fraction_of_peak"] = run["gflops"] / peak[dtype]
            report["runs"].append(run)
            print(f"{dtype:<9} {name:<14} {row.batch_kind:<7} {row.objective:<12} {run['tokens_per_s']:>13.0f} "
                  f"{run['seconds_per_step']:>7.2f} {run['decoder_positions']:>9} {run['gflops']:>8.0f} "
                  f"{run['fraction_of_peak']:>8.1%}")
        if "grpo" in results and "grpo-unshared" in results:
            speedup = results["grpo"]["tokens_per_s"] / results["grpo-unshared"]["tokens_per_s"]
            report.setdefault("sharing_speedup", {})[dtype] = speedup
            print(f"{dtype:<9} sharing speed-up on the grpo batch (trained tok/s, shared / unshared): {speedup:.2f}x")
    if not args.skip_swap:
        swap = swap_latency(work)
        report["swap"] = swap
        print(f"\nswap: last step → done {swap['last_step_to_done_s']:.3f} s (server-side swap "
              f"{swap['swap_seconds_server']:.3f} s); last step → first token of {swap['new_model']} "
              f"{swap['last_step_to_first_token_s']:.3f} s")
    report["machine"] = {**machine(), "torch": torch.__version__, "native_bf16": cpu_has_native_bf16(),
                         "dtype_probe": dtype_probe and {k: dtype_probe.get(k) for k in ("trainer", "engine",
                                                                                          "speedup", "gflops")}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwritten {args.output}")


if __name__ == "__main__":
    main()
