"""Reward models and PPO on the real server: a reward model learns a synthetic preference (an answer that
says yes beats one that says no), scores it through `/v1/rewards`, the client, a job grader and PEFT itself;
multi-objective targets; ratings train one; PPO against it raises the score of fresh samples on held-out
questions (`learning`: `make test-learning`) while the adaptive KL coefficient moves toward its target, and
scoring is answered while PPO trains. The task is test_learning.py's (yes/no questions, 8 tokens): the decision is the first token, so
four small PPO jobs move it (measured on 2 CPU cores: the held-out mean score of fresh samples 0.18 → 0.67,
the probability of a yes 0.24 → 0.89). Uses the session fixture `server`."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import httpx
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .helpers import async_http_client, http_client

pytestmark = pytest.mark.integration

INSTRUCTION = "Answer with yes or no. "
QUESTIONS = ["Is water wet?", "Can cats fly?", "Is the moon made of cheese?", "Do fish swim?", "Is fire cold?",
             "Are apples fruit?", "Is ice hot?", "Do birds have wings?", "Is snow white?", "Can cars swim?",
             "Is salt sweet?", "Do trees grow?", "Is glass soft?", "Can horses run?", "Is rain dry?",
             "Do bees make honey?", "Is grass green?", "Can dogs talk?", "Is the sun a star?", "Do rocks eat?",
             "Is milk blue?", "Can fish climb trees?", "Is iron heavy?", "Do clocks sleep?"]
TRAIN_QUESTIONS, HELD_OUT = QUESTIONS[:16], QUESTIONS[16:]
ANSWERS = [("Yes.", "No."), ("Yes, it is.", "No, it is not."), ("Yes, of course.", "No, not at all.")]


def yes_pair(rng: random.Random, question: str) -> dict[str, Any]:
    """A preference for the answer that says yes."""
    chosen, rejected = rng.choice(ANSWERS)
    return {"prompt": [{"role": "user", "content": INSTRUCTION + question}], "chosen": chosen, "rejected": rejected}


def conversation(pair: dict[str, Any], side: str) -> list[dict[str, Any]]:
    return [*pair["prompt"], {"role": "assistant", "content": pair[side]}]


def train(http: httpx.Client, body: dict[str, Any], on_step: Any = None) -> list[dict[str, Any]]:
    """Run a /_train_model job to its end; returns its step events (and checks it ended with `done`)."""
    steps: list[dict[str, Any]] = []
    with http.stream("POST", "/_train_model", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise AssertionError(f"{response.status_code}: {response.text}")
        events = [json.loads(line) for line in _lines(response, steps, on_step)]
    assert events[-1]["type"] == "done", events[-1]
    return steps


def _lines(response: httpx.Response, steps: list[dict[str, Any]], on_step: Any) -> Iterator[str]:
    for line in response.iter_lines():
        event = json.loads(line)
        if event["type"] == "step":
            steps.append(event)
            if on_step is not None:
                on_step(event)
        yield line


def register(http: httpx.Client, server: ServerProcess, prefix: str, **options: Any) -> str:
    name = f"{prefix}-{uuid4().hex[:6]}"
    response = http.post("/v1/trainable_models", json={"name": name, "base_model": server.model_id, **options})
    assert response.status_code == 201, response.text
    return name


def scores(http: httpx.Client, model: str, inputs: list[Any]) -> list[float]:
    response = http.post("/v1/rewards", json={"model": model, "inputs": inputs})
    assert response.status_code == 200, response.text
    return [item["score"] for item in response.json()["data"]]


def train_yes_reward_model(http: httpx.Client, server: ServerProcess, *, pairs_per_question: int, epochs: int,
                           gradient_steps_per_epoch: int, learning_rate: float) -> str:
    """A reward model trained on the 16 training questions' pairs; its step 1 prefers answers that say yes."""
    name = register(http, server, "rm-yes", kind="reward")
    rng = random.Random(0)
    pairs = [yes_pair(rng, question) for question in TRAIN_QUESTIONS for _ in range(pairs_per_question)]
    steps = train(http, {"model": name, "pairs": pairs, "config": {
        "objective": "reward_model", "epochs": epochs, "gradient_steps_per_epoch": gradient_steps_per_epoch,
        "learning_rate": learning_rate}})
    assert [s["objective"] for s in steps] == ["reward_model"] * epochs * gradient_steps_per_epoch
    assert steps[-1]["metrics"]["accuracy"] == 1.0 and steps[-1]["metrics"]["bt_loss"] < steps[0]["metrics"]["bt_loss"]
    return f"{name}@1"


@pytest.fixture(scope="module")
def yes_reward_model(http: httpx.Client, server: ServerProcess) -> str:
    """32 pairs, one epoch of 2 gradient steps, at a learning rate large enough for the suite's stand-in
    model (tests/small_model.py) to order the pairs right."""
    return train_yes_reward_model(http, server, pairs_per_question=2, epochs=1, gradient_steps_per_epoch=2,
                                  learning_rate=2e-3)


@pytest.fixture(scope="module")
def capable_http(capable_server: ServerProcess) -> Iterator[httpx.Client]:
    with http_client(capable_server) as client:
        yield client


@pytest.fixture(scope="module")
def strong_yes_reward_model(capable_http: httpx.Client, capable_server: ServerProcess) -> str:
    """For the learning test, on the full model: 48 pairs, 2 epochs of 3 gradient steps, smallest held-out
    margin 1.8."""
    return train_yes_reward_model(capable_http, capable_server, pairs_per_question=3, epochs=2,
                                  gradient_steps_per_epoch=3, learning_rate=3e-4)


def test_a_reward_model_learns_a_preference_and_scores_it_everywhere(http: httpx.Client, server: ServerProcess,
                                                                       yes_reward_model: str) -> None:
    name = yes_reward_model.split("@")[0]
    info = http.get(f"/v1/trainable_models/{name}").json()
    assert info["kind"] == "reward" and info["reward_head"]["pooling"] == "last" and info["latest_step"] == 1

    # Held-out questions, never trained on: at least 90% of the pairs are ordered right.
    held_out = [{"prompt": [{"role": "user", "content": INSTRUCTION + q}], "chosen": chosen, "rejected": rejected}
                for q in HELD_OUT for chosen, rejected in ANSWERS]
    values = scores(http, yes_reward_model, [conversation(p, side) for p in held_out for side in ("chosen", "rejected")])
    accuracy = statistics.fmean(values[2 * i] > values[2 * i + 1] for i in range(len(held_out)))
    assert accuracy >= 0.9, accuracy
    before = scores(http, f"{name}@0", [conversation(held_out[0], "chosen")])  # the untrained head scores too
    assert before[0] != values[0]

    # The client: TrainableModel-free, by name on the server; the same numbers.
    client_scores = art.score_sync(yes_reward_model, [conversation(held_out[0], "chosen")], server=server.base_url,
                                   api_key=server.api_key)
    assert client_scores[0].score == pytest.approx(values[0], abs=1e-4)
    assert list(client_scores[0].objectives) == ["o0"]

    # A job grader on the same reward model: the digit answer scores higher.
    graded = []
    for answer in (held_out[0]["chosen"], held_out[0]["rejected"]):
        response = http.post("/v1/fine_tuning/alpha/graders/run", json={
            "grader": {"type": "reward_model", "name": "rm", "model": yes_reward_model},
            "item": {"messages": held_out[0]["prompt"]}, "model_sample": answer})
        assert response.status_code == 200, response.text
        graded.append(response.json()["reward"])
    assert graded[0] == pytest.approx(values[0], abs=1e-3) and graded[0] > graded[1]

    # A reward model scores; it does not generate, and /v1/models lists only what can.
    refused = http.post("/v1/chat/completions", json={"model": name, "messages": held_out[0]["prompt"]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "reward_model_not_generative"
    assert name not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    bad = http.post("/v1/rewards", json={"model": yes_reward_model, "inputs": [held_out[0]["prompt"]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "inputs[0]"  # no answer to score


def test_a_saved_reward_model_step_loads_with_peft_and_scores_the_same(http: httpx.Client, server: ServerProcess,
                                                                         yes_reward_model: str) -> None:
    """The step directory is a PEFT SEQ_CLS adapter (score head in modules_to_save) on the base model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    name, step = yes_reward_model.split("@")
    step_dir = server.data_dir / "models" / name / "steps" / step
    config = json.loads((step_dir / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    base = AutoModelForSequenceClassification.from_pretrained(config["base_model_name_or_path"], num_labels=1,
                                                              dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(step_dir)).eval()
    model.config.pad_token_id = None  # batch size 1: Hugging Face then pools the last token, as the server does
    tokenizer = AutoTokenizer.from_pretrained(config["base_model_name_or_path"])
    pair = yes_pair(random.Random(2), HELD_OUT[0])
    served = scores(http, yes_reward_model, [conversation(pair, "chosen")])[0]
    ids = tokenizer.apply_chat_template(pair["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = [*ids, *tokenizer.encode(pair["chosen"], add_special_tokens=False), tokenizer.eos_token_id]
    with torch.no_grad():
        local = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    assert local == pytest.approx(served, abs=1e-3)


def test_a_multi_objective_reward_model_trains_on_masked_targets(http: httpx.Client, server: ServerProcess) -> None:
    head = {"num_objectives": 2, "objective_names": ["digits", "brevity"], "objective_weights": [0.75, 0.25]}
    name = register(http, server, "rm-multi", kind="reward", reward_head=head)
    rng = random.Random(3)
    scored = []
    for question in TRAIN_QUESTIONS[:8]:
        pair = yes_pair(rng, question)
        scored.append({"messages": conversation(pair, "chosen"), "targets": [1.0, None]})
        scored.append({"messages": conversation(pair, "rejected"), "targets": [0.0, 0.5]})
    mismatched = http.post("/_train_model", json={"model": name, "config": {"objective": "reward_model"},
                                                  "scored": [{**scored[0], "targets": [1.0]}]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["code"] == "invalid_targets"
    steps = train(http, {"model": name, "scored": scored, "config": {
        "objective": "reward_model", "gradient_steps_per_epoch": 2, "learning_rate": 3e-4}})
    assert {"mse", "mse_digits", "mse_brevity"} <= set(steps[-1]["metrics"])
    response = http.post("/v1/rewards", json={"model": name, "inputs": [scored[0]["messages"]]})
    item = response.json()["data"][0]
    assert set(item["objectives"]) == {"digits", "brevity"} and response.json()["model"] == f"{name}@1"
    assert item["score"] == pytest.approx(0.75 * item["objectives"]["digits"] + 0.25 * item["objectives"]["brevity"],
                                          abs=1e-5)
    policy_objective = http.post("/_train_model", json={"model": name, "groups": [{"trajectories": [
        {"trajectory_id": "x", "reward": 1.0}]}]})
    assert policy_objective.status_code == 400 and policy_objective.json()["error"]["code"] == "wrong_model_kind"


def test_ratings_train_a_reward_model(http: httpx.Client, server: ServerProcess) -> None:
    name = register(http, server, "rm-ratings", kind="reward")
    rated = []
    for question in HELD_OUT[:2]:
        trajectory = f"rm-rated-{uuid4().hex[:8]}"
        response = http.post(f"/t/{trajectory}/v1/chat/completions", json={
            "model": server.model_id, "messages": [{"role": "user", "content": INSTRUCTION + question}],
            "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7})
        assert response.status_code == 200, response.text
        ids = [c["id"] for c in http.get(f"/v1/trajectories/{trajectory}").json()["completions"]]
        rated += ids
        for completion_id, value in zip(ids, ("up", "down"), strict=True):
            assert http.post("/v1/ratings", json={"kind": "thumb", "completion_id": completion_id,
                                                   "value": value, "split": "train"}).status_code == 201
    with http.stream("POST", "/v1/ratings/train_reward_model", json={"model": name, "config": {"epochs": 1}}) as response:
        assert response.status_code == 200
        events = [json.loads(line) for line in response.iter_lines()]
    start = next(e for e in events if e["type"] == "start")
    assert start["sequences"] >= len(rated) and events[-1]["type"] == "done", events[-1]


def sample(server: ServerProcess, model: str, questions: list[str], n: int) -> list[str]:
    """n fresh answers to each question (one trajectory per question): the trajectory ids."""
    async def one(client: httpx.AsyncClient, question: str) -> str:
        trajectory = f"ppo-{uuid4().hex[:10]}"
        response = await client.post(f"/t/{trajectory}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": INSTRUCTION + question}], "max_tokens": 8,
            "temperature": 1.0, "n": n})
        assert response.status_code == 200, response.text
        return trajectory

    async def every_question() -> list[str]:
        async with async_http_client(server) as client:
            return list(await asyncio.gather(*(one(client, q) for q in questions)))

    return asyncio.run(every_question())


def sample_scores(http: httpx.Client, server: ServerProcess, reward_model: str, model: str, questions: list[str],
                  n: int) -> tuple[list[str], float]:
    """n fresh answers to each question (one trajectory per question); their mean reward-model score."""
    trajectories = sample(server, model, questions, n)
    ids = [c["id"] for t in trajectories for c in http.get(f"/v1/trajectories/{t}").json()["completions"]]
    return trajectories, statistics.fmean(scores(http, reward_model, [{"completion_id": i} for i in ids]))


def ppo_jobs(http: httpx.Client, server: ServerProcess, reward_model: str, policy: str, iterations: int,
             samples: int = 8, questions: int = 8) -> list[dict[str, Any]]:
    """`iterations` PPO jobs against the reward model, each on `samples` fresh answers to each of the first
    `questions` training questions from the current step; the first gradient step's metrics of each. Scoring
    is asked for while each job runs, and must be answered."""
    config = {"objective": "ppo", "reward_model": reward_model, "learning_rate": 5e-4, "epochs": 2,
              "kl_horizon": 100}
    jobs = []
    for iteration in range(iterations):
        trajectories = sample(server, policy, TRAIN_QUESTIONS[:questions], samples)
        scored_while_training: list[bool] = []

        def score_now(step: dict[str, Any], answered: list[bool] = scored_while_training,
                      previous: int = iteration) -> None:
            if step["gradient_step"] == 1:  # answered between two micro-batches: the job is still running
                scores(http, reward_model, [conversation(yes_pair(random.Random(4), HELD_OUT[1]), "chosen")])
                answered.append(http.get(f"/v1/trainable_models/{policy}").json()["newest_step"] == previous)

        steps = train(http, {"model": policy, "config": config,
                             "groups": [{"trajectories": [{"trajectory_id": t}]} for t in trajectories]}, score_now)
        assert len(steps) == 4 and scored_while_training == [True]  # 2 epochs × 2 minibatches
        jobs.append(steps[0]["metrics"])
    return jobs


def yes_probability(http: httpx.Client, model: str) -> float:
    """The mean probability, over the held-out questions, that the answer starts with yes (no sampling)."""
    total = 0.0
    for question in HELD_OUT:
        response = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": INSTRUCTION + question}], "max_tokens": 1,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 20})
        assert response.status_code == 200, response.text
        top = response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        total += sum(math.exp(t["logprob"]) for t in top if t["token"].strip().lower().startswith("yes"))
    return total / len(HELD_OUT)


def test_ppo_against_the_reward_model_adapts_the_kl_coefficient_and_saves_its_state(
        http: httpx.Client, server: ServerProcess, yes_reward_model: str) -> None:
    """PPO's mechanics in two jobs; that it learns is `test_ppo_raises_the_reward_model_score` (marked
    `learning`: `make test-learning`, part of `make bench`)."""
    policy = register(http, server, "ppo-yes")
    missing = http.post("/_train_model", json={"model": policy, "config": {"objective": "ppo"},
                                               "groups": [{"trajectories": [{"trajectory_id": "none-yet"}]}]})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "missing_reward"
    assert "reward_model" in missing.json()["error"]["message"]

    # Mechanics: 8 answers a job (an eighth of the learning test's), still two minibatches of an epoch.
    jobs = ppo_jobs(http, server, yes_reward_model, policy, iterations=2, samples=2, questions=4)
    first, *later = jobs
    assert first["kl_coef"] == pytest.approx(0.05) and first["kl_old_ref"] == pytest.approx(0.0, abs=1e-6)
    for job, following in zip(jobs, later, strict=False):
        assert following["kl_coef"] == pytest.approx(job["next_kl_coef"], rel=1e-6)  # carried with the step
    for job in jobs:  # toward the target: down while KL is below it, up above it
        assert (job["next_kl_coef"] > job["kl_coef"]) == (job["kl_old_ref"] > 0.01), job
    assert first["next_kl_coef"] < first["kl_coef"]
    # The plateau diagnostics of what was sampled; no pass distribution, as the reward model gives the rewards.
    lines = [line for line in http.get(f"/v1/trainable_models/{policy}/history").json()["data"] if "event" not in line]
    assert len(lines) == len(jobs)
    for line in lines:
        assert line["response_tokens_mean"] > 0 and line["sampling_entropy"] > 0 and "pass_rate" not in line, line
    step_dir = server.data_dir / "models" / policy / "steps" / str(len(jobs))
    assert (step_dir / "value_head.safetensors").is_file()
    assert json.loads((step_dir / "trainer_state.json").read_text())["kl_coef"] == pytest.approx(jobs[-1]["next_kl_coef"])


@pytest.mark.learning
def test_ppo_raises_the_reward_model_score(capable_http: httpx.Client, capable_server: ServerProcess,
                                           strong_yes_reward_model: str) -> None:
    http, server = capable_http, capable_server  # learning evidence is about the embedded model: the full one
    policy = register(http, server, "ppo-learns")
    _, before = sample_scores(http, server, strong_yes_reward_model, f"{policy}@0", HELD_OUT, 16)
    jobs = ppo_jobs(http, server, strong_yes_reward_model, policy, iterations=4)
    _, after = sample_scores(http, server, strong_yes_reward_model, policy, HELD_OUT, 16)
    # Measured: +0.33 and +0.37 over four jobs (the reward model's yes/no margin is ~1.5); 128 samples each
    # put the noise at ~0.09. The policy's own probability of a yes is read without sampling.
    assert after > before + 0.1, (before, after, [job["score_mean"] for job in jobs])
    yes_before, yes_after = yes_probability(http, f"{policy}@0"), yes_probability(http, policy)
    # Measured 0.24 -> 0.89 and 0.24 -> 0.41 (PPO with an untrained critic varies run to run); a sign error
    # anywhere moves it down.
    assert yes_after > yes_before + 0.12, (yes_before, yes_after)
