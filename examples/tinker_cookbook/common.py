"""What the cookbook recipes need to run against an artlike server instead of the hosted service."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

RENDERER = "qwen3_instruct"
"""The cookbook renderer that writes the embedded model's chat format: ChatML (`<|im_start|>`, `<|im_end|>`
as the stop token), no thinking block."""


def connect(server: str, api_key: str | None) -> None:
    """Point the SDK at `server`: the cookbook builds its `ServiceClient` from these variables. The SDK
    insists on a key beginning with `tml-`; the server takes `tml-<its key>` (any `tml-` key when it has none)."""
    os.environ["TINKER_BASE_URL"] = server
    os.environ["TINKER_API_KEY"] = f"tml-{api_key or 'local'}"


def base_model_dir(explicit: str | None = None) -> str:
    """The base model as a local directory: the cookbook loads its tokenizer from there, with no hub."""
    if explicit:
        return explicit
    from artlike_server.default_model import ensure_default_model

    return str(ensure_default_model())


def metrics(log_path: str | Path) -> list[dict[str, float]]:
    """The cookbook's `metrics.jsonl`: one line per step."""
    lines = (Path(log_path) / "metrics.jsonl").read_bytes().splitlines()
    return [orjson.loads(line) for line in lines if line.strip()]
