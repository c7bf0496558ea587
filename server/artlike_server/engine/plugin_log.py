"""Loggers for artlike's vLLM plugins that reach the engine log whether or not vLLM configured logging.

vLLM's `python -m vllm.entrypoints.openai.api_server` path can leave the root logger at WARNING, and then a
plugin's INFO lines under the "vllm" logger vanish; a plugin that patches vLLM must say so where operators
look (and where the tests read it)."""

from __future__ import annotations

import logging
import sys


def visible_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)`, given its own stderr handler at INFO when INFO would not be emitted."""
    logger = logging.getLogger(name)
    if not logger.isEnabledFor(logging.INFO) and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
