"""What the cookbook recipes need to run against an artlike server instead of the hosted service."""

from __future__ import annotations

import argparse
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


def arguments(description: str) -> argparse.ArgumentParser:
    """The options both scripts take: where the server is, its key, the base model and the log directory."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--server", default=os.environ.get("ARTLIKE_SERVER", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("ARTLIKE_API_KEY"))
    parser.add_argument("--model-dir", help="the server's base model directory (default: the embedded model)")
    parser.add_argument("--log-path", help="the cookbook's log directory (default: a new temporary one)")
    return parser
