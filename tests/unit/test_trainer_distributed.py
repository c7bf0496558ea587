"""torch_worker/distributed.py: the micro-batch split, the helpers around it, and the training loop on 2 gloo ranks
against 1 (a tiny random model, SGD: the update is the gradient itself, so its scale is compared too)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from artlike_server.torch_worker import distributed
from artlike_server.torch_worker.distributed import Ranks, in_step, rank_cpus, shard_micro_batches
from artlike_server.torch_worker.heads import ValueHead
from artlike_server.torch_worker.loop import PassTotals, run_optimizer_steps
from artlike_server.training.trainer_client import launcher_args

from artlike.types import GRPOConfig, PPOConfig, StepEvent
from tests.unit.test_ppo import ppo_batch
from tests.unit.test_training_loop import batch, tiny_peft_model

# ------------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize(("count", "world_size"), [(0, 2), (1, 2), (3, 2), (7, 3), (5, 1)])
def test_every_micro_batch_goes_to_exactly_one_rank(count: int, world_size: int) -> None:
    costs = [(7 * i) % 11 + 1 for i in range(count)]
    shards = shard_micro_batches(costs, world_size)
    assert len(shards) == world_size
    assert sorted(itertools.chain(*shards)) == list(range(count))
    assert all(shard == sorted(shard) for shard in shards)  # plan order within a rank
    assert shard_micro_batches(costs, world_size) == shards  # every rank computes the same split


def test_the_split_balances_the_cost() -> None:
    costs = [10, 9, 8, 2, 1, 1, 30, 4]
    for world_size in (2, 3):
        loads = [sum(costs[i] for i in shard) for shard in shard_micro_batches(costs, world_size)]
        assert max(loads) <= sum(costs) / world_size + max(costs)  # greedy's bound: no rank far above the mean
    assert shard_micro_batches([10, 9, 8, 2, 1, 1], 2) == [[0, 3, 4, 5], [1, 2]]  # 14 and 17
    assert shard_micro_batches([4], 3) == [[0], [], []]
    with pytest.raises(ValueError):
        shard_micro_batches([1], 0)


def test_each_cpu_rank_gets_its_own_cores() -> None:
    assert [rank_cpus([0, 1, 2, 3], r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_cpus(range(5), r, 2) for r in range(2)] == [[0, 1, 2], [3, 4]]  # type: ignore[arg-type]
    assert [rank_cpus([6], r, 2) for r in range(2)] == [[6], [6]]  # fewer cores than ranks: shared


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ([("ok", ""), ("ok", "")], True),
        ([("main_only", "OSError"), ("ok", "")], True),  # rank 0 failed to write, after the collectives
        ([("failed", "BatchError"), ("failed", "BatchError")], True),  # a bad command, refused by all
        ([("failed", "BatchError"), ("ok", "")], False),
        ([("ok", ""), ("failed", "OutOfMemoryError")], False),
        ([("failed", "BatchError"), ("failed", "DistBackendError")], False),
    ],
)
def test_ranks_stay_in_step_only_when_they_ended_a_command_alike(
    outcomes: list[distributed.Outcome], expected: bool
) -> None:
    assert in_step(outcomes) is expected


def test_pass_totals_of_the_ranks_add_up() -> None:
    first = PassTotals(loss=1.0, tokens=3, decoder_positions=10, metric_sums={"a": 1.0}, metric_counts={"a": 2.0},
                       sequence_logprobs={0: torch.zeros(2)})  # fmt: skip
    second = PassTotals(loss=0.5, tokens=4, decoder_positions=5, metric_sums={"a": 3.0, "b": 1.0},
                        metric_counts={"a": 2.0, "b": 1.0}, sequence_logprobs={1: torch.ones(3)})  # fmt: skip
    total = PassTotals.merged([first, second, PassTotals()])  # the last rank had no micro-batch
    assert (total.loss, total.tokens, total.decoder_positions) == (1.5, 7, 15)
    assert total.metrics() == {"a": 1.0, "b": 1.0}
    assert sorted(total.sequence_logprobs) == [0, 1]


def test_the_ranks_come_from_torchrun_s_environment() -> None:
    assert distributed.from_environment({}) == distributed.SINGLE
    ranks = distributed.from_environment({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.local_world_size) == (3, 4, 1, 2)
    assert ranks.distributed and not ranks.is_main


def test_several_devices_run_the_worker_under_torchrun() -> None:
    assert launcher_args(None, 1, "auto") == []
    assert launcher_args((3,), 1, "cuda") == []  # one GPU: a plain worker, CUDA_VISIBLE_DEVICES=3
    assert launcher_args((0, 1), 1, "auto")[-1] == "--nproc-per-node=2"
    assert launcher_args(None, 3, "cpu")[:2] == ["-m", "torch.distributed.run"]
    for gpus, ranks, device in [((0, 0), 1, "cuda"), ((0, 1), 1, "cpu"), ((0, 1), 2, "cuda"), (None, 2, "auto"),
                                (None, 0, "cpu"), ((), 1, "cuda")]:  # fmt: skip
        with pytest.raises(ValueError):
            launcher_args(gpus, ranks, device)


# ----------------------------------------------------------------------------- 2 gloo ranks vs 1

CASES = {  # name: (config, optimizer steps)
    "token": (GRPOConfig(micro_batch_tokens=100, max_grad_norm=None), 1),  # 4 micro-batches: 2 + 2 uneven
    "sequence": (GRPOConfig(micro_batch_tokens=100, loss_aggregation="sequence", max_grad_norm=None), 1),
    "two_steps": (GRPOConfig(micro_batch_tokens=100, gradient_steps_per_epoch=2, max_grad_norm=1.0), 2),
    "one_micro_batch": (GRPOConfig(micro_batch_tokens=4096, max_grad_norm=None), 1),  # rank 1 idle
    # a value head, and the once-per-job reference and policy/value passes (split between the ranks too)
    "ppo": (PPOConfig(micro_batch_tokens=100, epochs=1, gradient_steps_per_epoch=2, learning_rate=0.1), 2),
}


def train(config: GRPOConfig | PPOConfig, ranks: Ranks) -> tuple[list[StepEvent], list[torch.Tensor]]:
    model = tiny_peft_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    heads = {}
    if isinstance(config, PPOConfig):
        heads["value"] = ValueHead(32)
        optimizer.add_param_group({"params": list(heads["value"].parameters())})
    events: list[StepEvent] = []
    run_optimizer_steps(model, optimizer, ppo_batch() if heads else batch(), config, pad_token_id=0,
                        on_step=events.append, reference=model.disable_adapter, heads=heads, ranks=ranks)  # fmt: skip
    return events, [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]


def _rank_main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
        results = {name: train(config, ranks) for name, (config, _) in CASES.items()}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple[list[StepEvent], list[torch.Tensor]]]]:
    tmp = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank_main, args=(str(tmp / "store"), str(tmp / "result")), nprocs=2, join=True)
    return [torch.load(Path(f"{tmp / 'result'}.{rank}"), weights_only=False) for rank in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_as_one(
    two_rank_results: list[dict[str, tuple[list[StepEvent], list[torch.Tensor]]]], name: str
) -> None:
    config, steps = CASES[name]
    one_events, one_params = train(config, distributed.SINGLE)
    assert len(one_events) == steps
    for events, params in (result[name] for result in two_rank_results):  # each rank reports the whole step
        for got, expected in zip(events, one_events, strict=True):
            assert (got.tokens, got.decoder_positions) == (expected.tokens, expected.decoder_positions)
            for field in ("loss", "grad_norm", "entropy", "clip_fraction", "logprob_mismatch"):
                assert getattr(got, field) == pytest.approx(getattr(expected, field), rel=1e-5, abs=1e-7), field
        for got_param, expected_param in zip(params, one_params, strict=True):
            torch.testing.assert_close(got_param, expected_param, rtol=0, atol=1e-6)
    first, second = (result[name][1] for result in two_rank_results)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # the ranks stay identical
