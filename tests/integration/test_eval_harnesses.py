"""Standard evaluation harnesses against a trained step (`NAME@N`) on the real server: lm-evaluation-harness
through `local-chat-completions` (a generate_until task) and `local-completions` (a loglikelihood
multiple-choice task, which reads prompt logprobs from `echo` + `logprobs` and counts tokens through the
server's `/tokenize`), and inspect-ai's OpenAI-compatible provider. Each harness's per-sample answers and
score equal what the test computes itself through the OpenAI SDK with the same prompts, greedy decoding and
scoring rule. The tasks are the tiny local ones in tests/data/eval_tasks (no hub downloads). Uses the
session fixture `server` (tests/conftest.py)."""

from __future__ import annotations

import math
import string
from pathlib import Path
from typing import Any

import pytest
from artlike_server.launcher import ServerProcess

from .helpers import api_url, openai_client, sft_trained_model, trainable_model

pytestmark = pytest.mark.integration

TASKS = Path(__file__).parents[1] / "data" / "eval_tasks"
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
TARGET = "Paris."
MAX_TOKENS = 8  # the tasks' max_gen_toks / max_tokens


@pytest.fixture(scope="module")
async def step(server: ServerProcess) -> str:
    """`NAME@1` of a model whose step 1 the real trainer wrote (one short SFT step)."""
    model = await sft_trained_model(server, "evals", [*PROMPT, {"role": "assistant", "content": TARGET}], epochs=2)
    return f"{model.name}@1"


@pytest.fixture
def offline_harness(monkeypatch: pytest.MonkeyPatch, server: ServerProcess) -> None:
    """lm-eval reads the API key from OPENAI_API_KEY; the tasks' data files are relative to their folder."""
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key or "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS)


def capitals() -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (TASKS / "capitals.jsonl").read_text().splitlines()]


def lm_eval_samples(task: str, model: str, model_args: dict[str, Any], **options: Any) -> tuple[
        dict[str, Any], list[dict[str, Any]]]:
    """lm-eval's metrics and per-sample log for one task of tests/data/eval_tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                      task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                      **options)
    assert results is not None
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return results["results"][task], samples


def exact_match(answer: str, target: str) -> bool:
    """lm-eval's `exact_match` with the generate task's options: ignore case and punctuation."""
    table = str.maketrans("", "", string.punctuation)
    return answer.lower().translate(table) == target.lower().translate(table)


def test_lm_eval_chat_completions_scores_a_step(server: ServerProcess, step: str, offline_harness: None) -> None:
    metrics, samples = lm_eval_samples(
        "artlike_capitals_generate", "local-chat-completions",
        {"base_url": f"{api_url(server)}/chat/completions", "model": step}, apply_chat_template=True)

    client = openai_client(server)
    direct = []
    for record in capitals():
        reply = client.chat.completions.create(
            model=step, temperature=0, max_tokens=MAX_TOKENS, stop=["\n"],
            messages=[{"role": "user", "content": f"{record['question']} Answer with one word."}])
        direct.append(reply.choices[0].message.content or "")
    assert [sample["resps"][0][0] for sample in samples] == direct
    targets = [record["choices"][record["label"]] for record in capitals()]
    assert [sample["exact_match"] for sample in samples] == [
        float(exact_match(answer, target)) for answer, target in zip(direct, targets, strict=True)]
    assert metrics["exact_match,none"] == sum(map(exact_match, direct, targets)) / len(direct)


def continuation_logprob(client: Any, model: str, context: str, continuation: str) -> float:
    """The summed logprob of `continuation`'s tokens after `context`, read from the completions route's
    prompt logprobs (`echo` + `logprobs`): the tokens whose text starts at or after the context's end."""
    reply = client.completions.create(model=model, prompt=context + continuation, echo=True, logprobs=1,
                                      max_tokens=1, temperature=0)
    logprobs = reply.choices[0].logprobs
    prompt_tokens = reply.usage.prompt_tokens
    offsets = logprobs.text_offset[:prompt_tokens]
    values = logprobs.token_logprobs[:prompt_tokens]
    return sum(value for offset, value in zip(offsets, values, strict=True) if offset >= len(context))


def test_lm_eval_completions_loglikelihood_matches_prompt_logprobs(server: ServerProcess, step: str,
                                                                  offline_harness: None) -> None:
    metrics, samples = lm_eval_samples(
        "artlike_capitals_choice", "local-completions",
        {"base_url": f"{api_url(server)}/completions", "model": step, "auth_token": server.api_key})

    client = openai_client(server)
    chosen = []
    for record, sample in zip(capitals(), samples, strict=True):
        context = f"Question: {record['question']}\nAnswer:"
        sums = [continuation_logprob(client, step, context, f" {choice}") for choice in record["choices"]]
        harness = [loglikelihood for loglikelihood, _greedy in sample["filtered_resps"]]
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(harness, sums, strict=True)), (harness, sums)
        chosen.append(max(range(len(sums)), key=sums.__getitem__))
        assert sample["acc"] == float(chosen[-1] == record["label"])
    assert metrics["acc,none"] == sum(c == r["label"] for c, r in zip(chosen, capitals(), strict=True)) / len(chosen)


def test_inspect_ai_openai_compatible_provider_scores_a_step(server: ServerProcess, step: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from inspect_ai import eval as inspect_eval

    monkeypatch.chdir(TASKS)  # inspect-ai resolves task files relative to the working directory only
    logs = inspect_eval("capitals_inspect.py", model=f"openai-api/artlike/{step}",
                        model_base_url=api_url(server), model_args={"api_key": server.api_key},
                        log_dir=str(tmp_path), display="none")
    assert len(logs) == 1 and logs[0].status == "success", logs[0].error
    log = logs[0]
    assert log.samples is not None and log.results is not None
    harness = {str(sample.input): sample.output.completion for sample in log.samples}

    client = openai_client(server)
    correct = 0
    for record in capitals():
        prompt = f"{record['question']} Answer with one word."
        reply = client.chat.completions.create(model=step, temperature=0, max_tokens=MAX_TOKENS,
                                               messages=[{"role": "user", "content": prompt}])
        answer = reply.choices[0].message.content or ""
        assert harness[prompt] == answer
        correct += record["choices"][record["label"]].lower() in answer.lower()
    accuracy = log.results.scores[0].metrics["accuracy"].value
    assert accuracy == correct / len(capitals())


def test_a_harness_score_records_as_a_step_evaluation(server: ServerProcess, step: str) -> None:
    name, _, number = step.partition("@")
    model = trainable_model(server, name)
    line = model.log_evaluation_sync(int(number), {"capitals_acc": 0.75}, split="lm-eval")
    assert (line["event"], line["step"], line["split"], line["eval"]) == ("eval", 1, "lm-eval", {"capitals_acc": 0.75})
