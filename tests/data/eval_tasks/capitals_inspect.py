"""An inspect-ai task over capitals.jsonl: the model answers each question in words (greedy, 8 tokens);
a sample is correct when the right capital appears in its answer (`includes`, case-insensitive)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inspect_ai import Task, task
from inspect_ai.dataset import Sample, json_dataset
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

DATA = Path(__file__).with_name("capitals.jsonl")


def capital_sample(record: dict[str, Any]) -> Sample:
    return Sample(input=f"{record['question']} Answer with one word.", target=record["choices"][record["label"]])


@task
def capitals() -> Task:
    return Task(dataset=json_dataset(str(DATA), capital_sample), solver=generate(), scorer=includes(),
                config=GenerateConfig(temperature=0.0, max_tokens=8))
