"""The studio's loop with simulated raters: rate through the API, let continual training move the model.

Starts its own `artlike serve` (default model), registers a model and switches its continual training on
(`PATCH /v1/trainable_models/{name}/continual`: a step every `--every` ratings). Then, round after round,
it samples answers to everyday prompts through trajectory URLs (as the studio's playground does), and a
scripted rater posts a 1-5 rating for each (`POST /v1/ratings`) according to one preference:

    short     shorter answers are better (5 for at most 15 words ... 1 for more than 45)

After every background step it samples fresh answers to held-out prompts from the served alias (never
rated) and scores them with the same rater: the mean rating of fresh samples per step shows whether the
model moves toward the raters' preference.

    python -m bench.feedback_loop [--ratings 320] [--every 16] [--answers 4]

Prints a table and writes `bench/results/feedback_loop.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
from artlike_server.launcher import ServerProcess

from bench.machine import machine

RESULTS = Path(__file__).resolve().parent / "results" / "feedback_loop.json"
TOPICS = ["the ocean", "coffee", "a bicycle", "the moon", "winter", "a library", "music", "a garden", "trains",
          "bread", "the desert", "a river", "cats", "mountains", "rain", "a city", "chess", "tea", "forests",
          "the sun", "books", "bridges", "snow", "birds"]
HELD_OUT = ["the wind", "a lighthouse", "apples", "a violin", "clouds", "a market", "honey", "stars"]


def prompt(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about {topic}."}]


def short_rater(text: str) -> int:
    """The scripted preference: fewer words, higher rating (an answer cut off at 64 tokens has ~48 words)."""
    words = len(text.split())
    return 5 if words <= 15 else 4 if words <= 25 else 3 if words <= 35 else 2 if words <= 45 else 1


async def answer(http: httpx.AsyncClient, model: str, topic: str, max_tokens: int, temperature: float,
                 trajectory: str | None = None) -> tuple[str, int | None]:
    """An answer through a trajectory URL (recorded) and its completion id."""
    trajectory = trajectory or f"bench-{uuid4().hex[:12]}"
    response = await http.post(f"/t/{trajectory}/v1/chat/completions", json={
        "model": model, "messages": prompt(topic), "max_tokens": max_tokens, "temperature": temperature,
        "metadata": {"source": "feedback-bench"}})
    response.raise_for_status()
    text = response.json()["choices"][0]["message"]["content"] or ""
    records = (await http.get(f"/v1/trajectories/{trajectory}")).json()["completions"]
    return text, records[0]["id"] if records else None


async def fresh_rating(http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> dict[str, float]:
    """Mean simulated rating and words of fresh samples to the held-out prompts (not posted)."""
    texts = await asyncio.gather(*(answer(http, model, topic, args.max_tokens, args.temperature)
                                   for topic in HELD_OUT for _ in range(args.eval_samples)))
    ratings = [short_rater(text) for text, _ in texts]
    return {"mean_rating": statistics.fmean(ratings), "mean_words": statistics.fmean(len(t.split()) for t, _ in texts)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data_dir, \
            ServerProcess(Path(data_dir), args=["--dtype", "auto", "--trainer-dtype", "auto"], api_key="bench") as server:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=600) as http:
            name = f"feedback-{uuid4().hex[:6]}"
            (await http.post("/v1/trainable_models", json={"name": name, "base_model": server.model_id})
             ).raise_for_status()
            (await http.patch(f"/v1/trainable_models/{name}/continual", json={
                "enabled": True, "every": args.every, "learning_rate": args.learning_rate, "replay": args.replay,
                "epochs": args.epochs,
            })).raise_for_status()
            rows = [{"step": 0, "ratings": 0, **await fresh_rating(http, name, args), "seconds": 0.0}]
            print(f"{'step':>4} {'ratings':>7} {'fresh rating':>12} {'words':>6} {'seconds':>8}")
            print(f"{0:>4} {0:>7} {rows[0]['mean_rating']:>12.2f} {rows[0]['mean_words']:>6.1f} {0.0:>8.1f}")
            started = time.monotonic()
            rated, topic_index = 0, 0
            while rated < args.ratings:
                # One round: `every` ratings, `answers` answers per prompt (a GRPO group per prompt).
                topics = [TOPICS[(topic_index + i) % len(TOPICS)] for i in range(args.every // args.answers)]
                topic_index += len(topics)
                answers = await asyncio.gather(*(answer(http, name, topic, args.max_tokens, args.temperature)
                                                 for topic in topics for _ in range(args.answers)))
                before = (await http.get(f"/v1/trainable_models/{name}/continual")).json()
                for text, completion_id in answers:
                    (await http.post("/v1/ratings", json={"kind": "scale", "completion_id": completion_id,
                                                          "value": short_rater(text), "rater": "short"})
                     ).raise_for_status()
                    rated += 1
                status = await wait_for_run(http, name, before)
                live = status["live_step"]
                row = {"step": live, "ratings": rated, **await fresh_rating(http, name, args),
                       "seconds": round(time.monotonic() - started, 1), "run": status["last_run"]["reason"]}
                rows.append(row)
                print(f"{live:>4} {rated:>7} {row['mean_rating']:>12.2f} {row['mean_words']:>6.1f} "
                      f"{row['seconds']:>8.1f}")
            history = (await http.get(f"/v1/trainable_models/{name}/history")).json()["data"]
    report = {"preference": "short", "settings": vars(args), "rows": rows,
              "first": rows[0]["mean_rating"], "last": rows[-1]["mean_rating"],
              "best": max(r["mean_rating"] for r in rows),
              "train_seconds": [h.get("train_seconds") for h in history if isinstance(h.get("step"), int)],
              "machine": machine()}
    print(f"fresh-sample rating {report['first']:.2f} -> {report['last']:.2f} (best {report['best']:.2f}) after "
          f"{rows[-1]['ratings']} ratings; words {rows[0]['mean_words']:.1f} -> {rows[-1]['mean_words']:.1f}")
    return report


async def wait_for_run(http: httpx.AsyncClient, name: str, before: dict[str, Any]) -> dict[str, Any]:
    previous = before["last_run"]["started_at"] if before["last_run"] else 0.0
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        status: dict[str, Any] = (await http.get(f"/v1/trainable_models/{name}/continual")).json()
        run = status["last_run"]
        if run and run["started_at"] > previous and run["finished_at"] and status["state"] == "waiting":
            return status
        await asyncio.sleep(1)
    raise TimeoutError("no continual step finished in 15 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratings", type=int, default=320)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--answers", type=int, default=4, help="answers per prompt in a round")
    parser.add_argument("--replay", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=2, help="passes over each step's ratings")
    parser.add_argument("--eval-samples", type=int, default=4, help="fresh samples per held-out prompt per step")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    report = asyncio.run(run(parser.parse_args()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
