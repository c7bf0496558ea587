"""The official `tinker` SDK against the real server: the quickstart's path and the REST listing.

A training client on the base model (a run that is also a trainable model of the server): cross_entropy
`forward_backward` whose `loss:sum` is the weighted sum of the logprobs it returns, `optim_step`, a lower loss
after it; `save_weights_and_get_sampling_client` samples the new step on the engine (greedy: the same tokens
as `/v1/completions` on `name@N`), `compute_logprobs` gives the prompt's logprobs; named checkpoints (`save_state`,
`save_weights_for_sampler`) are listed by the REST client, sampled and resumed from
(`create_training_client_from_state_with_optimizer`); `forward_backward_custom` runs its round trip; bad
requests raise the SDK's own errors. Uses the session fixture
`server` (tests/conftest.py).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import tinker
import torch
from artlike_server.launcher import ServerProcess
from tinker import types

from examples.tinker_cookbook import math_rl as cookbook_math_rl
from examples.tinker_cookbook import sft as cookbook_sft

pytestmark = pytest.mark.integration

PROMPT = "Question: what colour is the sky?\nAnswer:"
ANSWER = " The sky is blue."


def tokens_of(server: ServerProcess, text: str, *, special: bool) -> list[int]:
    reply = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=30,
                       json={"prompt": text, "add_special_tokens": special})
    reply.raise_for_status()
    return list(reply.json()["tokens"])


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-{server.api_key}")


def datum(prompt: list[int], answer: list[int]) -> types.Datum:
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def test_the_quickstart_trains_saves_and_samples_the_new_step(server: ServerProcess,
                                                               service: tinker.ServiceClient) -> None:
    rest = tinker.RestClient(base_url=server.base_url, api_key=f"tml-{server.api_key}")
    capabilities = rest.get_server_capabilities().result()
    assert server.model_id in [model.model_name for model in capabilities.supported_models]
    training = service.create_lora_training_client(base_model=server.model_id, rank=8).result()
    run_id = training.model_id
    model = run_id.replace(":", "-")
    listed = httpx.get(f"{server.base_url}/v1/trainable_models/{model}", headers=server.headers, timeout=30)
    assert listed.status_code == 200 and listed.json()["lora"]["rank"] == 8

    prompt, answer = tokens_of(server, PROMPT, special=True), tokens_of(server, ANSWER, special=False)
    data = [datum(prompt, answer)]
    first = training.forward_backward(data, "cross_entropy").result()
    logprobs = first.loss_fn_outputs[0]["logprobs"].tolist()
    weights = data[0].loss_fn_inputs["weights"].tolist()
    assert len(logprobs) == len(prompt) + len(answer) - 1
    assert first.metrics["loss:sum"] == pytest.approx(-sum(lp * w for lp, w in zip(logprobs, weights, strict=True)),
                                                      rel=1e-4)
    training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    after = training.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < first.metrics["loss:sum"]

    # The new weights on the engine: greedy samples are what /v1/completions gives for the step.
    sampler = training.save_weights_and_get_sampling_client().result()
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result()
    sequence = sampled.sequences[0]
    assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens) > 0
    steps = httpx.get(f"{server.base_url}/v1/trainable_models/{model}/steps", headers=server.headers, timeout=30)
    step = max(entry["step"] for entry in steps.json()["data"])
    served = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=120,
                        json={"model": f"{model}@{step}", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                              "return_token_ids": True})
    assert served.json()["choices"][0]["token_ids"] == sequence.tokens
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    assert all(value is not None and value <= 0 and math.isfinite(value) for value in prompt_logprobs[1:])

    # Named checkpoints: a sampler's weights and a training state, listed, sampled and resumed from.
    saved = training.save_state("after-one-step").result()
    assert saved.path == f"tinker://{run_id}/weights/after-one-step"
    named = training.save_weights_for_sampler("quickstart").result().path
    again = service.create_sampling_client(model_path=named).result()
    assert again.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                        sampling_params=greedy).result().sequences[0].tokens == sequence.tokens
    checkpoints = rest.list_checkpoints(run_id).result().checkpoints
    assert {c.checkpoint_id for c in checkpoints} == {"sampler_weights/quickstart", "weights/after-one-step"}
    run = rest.get_training_run(run_id).result()
    assert run.base_model == server.model_id and run.lora_rank == 8

    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.model_id != run_id
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        after.metrics["loss:sum"], rel=1e-4)

    # A custom loss: the SDK differentiates it from the returned logprobs and sends back the gradient
    # as cross_entropy weights, so twice the cross-entropy is twice its value.
    def twice_the_nll(batch: list[types.Datum], values: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        losses = [-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, values, strict=True)]
        return 2 * torch.stack(losses).sum(), {}

    custom = resumed.forward_backward_custom(data, twice_the_nll).result()
    assert custom.metrics["loss:sum"] == pytest.approx(2 * after.metrics["loss:sum"], rel=1e-3)

    # load_state brings a running client back to a checkpoint: its weights, with or without AdamW's state.
    # One more step from it equals that step in a new client made from the checkpoint the same way.
    adam = types.AdamParams(learning_rate=5e-3)

    def next_loss(client: tinker.TrainingClient) -> float:
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
        return float(client.forward(data, "cross_entropy").result().metrics["loss:sum"])

    moved = next_loss(training)
    with pytest.warns(FutureWarning):
        training.load_state(saved.path).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        after.metrics["loss:sum"], rel=1e-4)
    fresh = next_loss(training)
    assert fresh == pytest.approx(next_loss(service.create_training_client_from_state(saved.path).result()), rel=1e-4)
    with pytest.warns(FutureWarning):
        training.load_state_with_optimizer(saved.path).result()
    continued = next_loss(training)
    assert continued == pytest.approx(moved, rel=1e-4)
    assert abs(continued - fresh) > 1e-3 * abs(fresh)  # Adam's first step from zero moments is another step

    # Deleting a checkpoint forgets its name (the step it names is the model's served one: it stays).
    rest.delete_checkpoint_from_tinker_path(named).result()
    assert {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints} == {"weights/after-one-step"}
    assert rest.get_weights_info_by_tinker_path(saved.path).result().lora_rank == 8


def test_bad_requests_raise_the_sdks_errors(server: ServerProcess, service: tinker.ServiceClient) -> None:
    with pytest.raises(tinker.BadRequestError, match="serves base model"):
        service.create_lora_training_client(base_model="not/a-model", rank=8).result()
    training = service.create_lora_training_client(base_model=server.model_id, rank=4).result()
    shifted_wrong = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="shifted by one"):
        training.forward_backward([shifted_wrong], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        training.forward_backward([datum([1, 2], [3])], "stable_reinforce").result()


def trainer_passes(server: ServerProcess) -> tuple[float, float]:
    """The trainer's session passes so far, and how many of them ran fused with another session's."""
    exposition = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in exposition.splitlines()
              if line.startswith("artlike_trainer_")}  # fmt: skip
    return values["artlike_trainer_session_passes"], values["artlike_trainer_fused_passes"]


def test_concurrent_runs_train_apart_while_another_run_samples(server: ServerProcess,
                                                                          service: tinker.ServiceClient) -> None:
    prompt = tokens_of(server, PROMPT, special=True)
    answers = [" The sky is blue.", " It is red at dusk.", " Grey, mostly."]
    runs = [service.create_lora_training_client(base_model=server.model_id, rank=4).result() for _ in range(4)]
    trained, idle = runs[:3], runs[3]
    data = [[datum(prompt, tokens_of(server, answer, special=False))] for answer in answers]
    def losses() -> list[float]:
        return [run.forward(batch, "cross_entropy").result().metrics["loss:sum"]
                for run, batch in zip(trained, data, strict=True)]

    before = losses()
    idle_before = idle.forward(data[0], "cross_entropy").result().metrics["loss:sum"]
    sampler = idle.save_weights_and_get_sampling_client().result()

    def train(run: tinker.TrainingClient, batch: list[types.Datum]) -> None:
        for _ in range(2):
            run.forward_backward(batch * 4, "cross_entropy")  # submitted back to back, run in order
            run.optim_step(types.AdamParams(learning_rate=5e-3))
        run.forward(batch, "cross_entropy").result()

    passes_before, fused_before = trainer_passes(server)
    with ThreadPoolExecutor(max_workers=4) as pool:
        passes = [pool.submit(train, run, batch) for run, batch in zip(trained, data, strict=True)]
        # Samples of another run go to the engine while the passes queue at the trainer (that they never wait
        # for those passes is shown without the CPU race in tests/unit/test_tinker_service.py).
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                                 sampling_params=types.SamplingParams(max_tokens=4)).result()
        for p in passes:
            p.result()
    assert len(sampled.sequences) == 2
    passes_after, fused_after = trainer_passes(server)
    assert passes_after - passes_before == 9  # three runs' two forward_backward and one forward each
    assert fused_after > fused_before  # passes of several runs that waited at once ran as one
    after = losses()
    assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)
    # The run that only sampled is as it was: other runs' steps never touched its weights.
    assert idle.forward(data[0], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(idle_before, rel=1e-5)


def test_the_cookbooks_supervised_loop_runs_unmodified(server: ServerProcess, tmp_path: Path) -> None:
    lines = cookbook_sft.run(server.base_url, server.api_key, steps=2, batch_size=2, max_length=256,
                             log_path=str(tmp_path / "sft"))
    nll = [line["train_mean_nll"] for line in lines if "train_mean_nll" in line]
    assert len(nll) == 2 and all(math.isfinite(value) and value > 0 for value in nll)
    saved = [orjson.loads(line) for line in (tmp_path / "sft" / "checkpoints.jsonl").read_bytes().splitlines()]
    assert saved[-1]["name"] == "final" and saved[-1]["state_path"].startswith("tinker://")


def test_the_cookbooks_arithmetic_rl_recipe_runs_unmodified(server: ServerProcess, tmp_path: Path) -> None:
    lines = cookbook_math_rl.run(server.base_url, server.api_key, steps=2, groups_per_batch=2, group_size=4,
                                 log_path=str(tmp_path / "rl"))
    rewards = [line[cookbook_math_rl.REWARD] for line in lines if cookbook_math_rl.REWARD in line]
    assert len(rewards) == 2 and all(-0.1 <= value <= 1.0 for value in rewards)
