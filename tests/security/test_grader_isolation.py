"""Graders cannot stall the server: their text work runs in worker processes that are killed at a time limit
(the event loop keeps answering), and what they may be asked to compare is capped (400 before any work).

The integration tests use the shared server (`--grader-timeout 2`); the pool's own tests run it in-process."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from artlike_server.errors import InvalidRequest
from artlike_server.jobs.grader_pool import GraderLimits, GraderPool
from artlike_server.jobs.intake import check_grader_runnable
from artlike_server.jobs.rewards import JobReward
from artlike_server.jobs.sandbox import Sandbox
from artlike_server.jobs.spec import GraderReward

from artlike.graders import grade, parse_grader, run_leaf

GRADERS_RUN = "/v1/fine_tuning/alpha/graders/run"
# sympy evaluates the power tower in C (GMP): no SIGALRM reaches it; only killing the process stops it.
POWER_TOWER = r"The answer is \boxed{9^{9^{9^{9}}}}"
MATH = {"type": "math_accuracy", "name": "math", "input": "{{sample.output_text}}", "reference": "1"}
SIMILARITY = {"type": "text_similarity", "name": "sim", "input": "{{sample.output_text}}",
              "reference": "{{item.reference}}", "evaluation_metric": "rouge_l"}
SERVER_GRADER_TIMEOUT_S = 2.0  # tests/conftest.py's --grader-timeout
MAX_CHARS = 20_000  # the default --max-grader-chars


async def _health_latencies(async_http: httpx.AsyncClient, until: asyncio.Task[httpx.Response]) -> list[float]:
    latencies = []
    while not until.done():
        started = time.monotonic()
        response = await async_http.get("/health")
        latencies.append(time.monotonic() - started)
        assert response.status_code == 200
        await asyncio.sleep(0.1)
    return latencies


@pytest.mark.integration
async def test_a_stuck_grader_is_stopped_at_its_limit_while_the_server_keeps_answering(
        async_http: httpx.AsyncClient) -> None:
    # A first grade starts the workers, so the timing below is the grader's alone.
    warm = await async_http.post(GRADERS_RUN, json={"grader": SIMILARITY, "model_sample": "a b c",
                                              "item": {"reference": "a b d"}})
    assert warm.status_code == 200, warm.text
    started = time.monotonic()
    stuck = asyncio.create_task(async_http.post(GRADERS_RUN, json={"grader": MATH, "model_sample": POWER_TOWER}))
    latencies = await _health_latencies(async_http, stuck)
    response = await stuck
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "grader_timeout" and error["type"] == "timeout_error"
    assert "math accuracy" in error["message"] and "2 s" in error["message"]
    assert SERVER_GRADER_TIMEOUT_S <= elapsed < SERVER_GRADER_TIMEOUT_S + 3
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    # The killed worker is replaced: grading goes on.
    after = await async_http.post(GRADERS_RUN, json={"grader": MATH, "model_sample": r"\boxed{1}"})
    assert after.status_code == 200 and after.json()["reward"] == 1.0


@pytest.mark.integration
async def test_rouge_l_on_the_largest_texts_is_quick(async_http: httpx.AsyncClient) -> None:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(MAX_CHARS // 4))[:MAX_CHARS]
             for _ in range(2)]  # ~5,000 words each: rouge-score's own table took seconds for this
    started = time.monotonic()
    response = await async_http.post(GRADERS_RUN, json={"grader": SIMILARITY, "model_sample": texts[0],
                                                  "item": {"reference": texts[1]}})
    assert response.status_code == 200, response.text
    assert 0.0 < response.json()["reward"] < 1.0 and time.monotonic() - started < 1.5


@pytest.mark.integration
@pytest.mark.parametrize(("body", "param", "code"), [
    ({"grader": MATH, "model_sample": "1" * (MAX_CHARS + 1)}, "model_sample", "grader_input_too_large"),
    ({"grader": SIMILARITY, "model_sample": "x", "item": {"reference": "y" * (MAX_CHARS + 1)}}, "item",
     "grader_input_too_large"),
    ({"grader": {**SIMILARITY, "input": "{{item.reference}}" * 3}, "model_sample": "x",
      "item": {"reference": "y" * (MAX_CHARS // 2)}}, "item", "grader_input_too_large"),  # grown by its template
    ({"grader": {"type": "multi", "name": "m", "calculate_output": "a0",
                 "graders": {f"a{i}": MATH for i in range(17)}}, "model_sample": "1"}, "grader.graders",
     "too_many_graders"),
])
async def test_inputs_over_the_caps_are_refused(async_http: httpx.AsyncClient, body: dict[str, Any], param: str,
                                                code: str) -> None:
    response = await async_http.post(GRADERS_RUN, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


# ------------------------------------------------------------------------------- the pool, in-process


async def test_grader_workers_run_under_an_address_space_limit() -> None:
    pool = GraderPool(GraderLimits(workers=1, memory_bytes=768 << 20))
    try:
        assert await pool.compute("similarity", ["a b", "a b", "gleu"]) == 1.0
        (pid,) = pool.worker_pids
        limits = await asyncio.to_thread(Path(f"/proc/{pid}/limits").read_text)
        line = next(line for line in limits.splitlines() if line.startswith("Max address space"))
        assert line.split()[3:5] == [str(768 << 20)] * 2
    finally:
        await pool.close()


async def test_a_jobs_grader_that_times_out_scores_zero_with_the_reason(tmp_path: Path) -> None:
    pool = GraderPool(GraderLimits(timeout_s=1, workers=1))
    reward = JobReward(GraderReward(grader=MATH), Sandbox(tmp_path), judge=None, compute=pool.compute)
    try:
        started = time.monotonic()
        score = await reward.score([{"role": "assistant", "content": POWER_TOWER}], {})
        assert score.value == 0.0 and score.error is not None and "took longer than 1 s" in score.error
        assert time.monotonic() - started < 15  # the worker's start (imports) and the 1 s limit
        assert (await reward.score([{"role": "assistant", "content": r"\boxed{1}"}], {})).value == 1.0
    finally:
        await pool.close()


def test_the_client_side_graders_still_run_in_process() -> None:
    assert grade(MATH, r"so \boxed{1}").score == 1.0
    assert run_leaf("math_accuracy", [r"\boxed{\frac{1}{2}}", "0.5"]) == (1.0, r"\frac{1}{2}")


def test_rouge_l_agrees_with_rouge_score() -> None:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rng = random.Random(1)
    vocabulary = ["The", "cat", "sat,", "on", "a", "mat", "42", "é", "x-y", "--"]
    for _ in range(200):
        a, b = (" ".join(rng.choice(vocabulary) for _ in range(rng.randint(0, 30))) for _ in range(2))
        assert run_leaf("similarity", [a, b, "rouge_l"]) == scorer.score(b, a)["rougeL"].fmeasure


@pytest.mark.parametrize("metric", ["meteor", "cosine"])
def test_an_unsupported_metric_is_a_400_naming_the_field_not_a_500(metric: str) -> None:
    grader = parse_grader({"type": "multi", "name": "m", "calculate_output": "a", "graders": {
        "a": {"type": "text_similarity", "name": "a", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "evaluation_metric": metric}}})
    with pytest.raises(InvalidRequest) as raised:
        check_grader_runnable(grader, param="grader")
    assert raised.value.code == "unsupported_metric" and raised.value.param == "grader.evaluation_metric"
    assert metric in str(raised.value)
