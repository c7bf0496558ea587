"""vLLM's tokenizer routes, answered by the server's own copy of the base model's tokenizer:

    GET  /tokenizer_info   -> {"tokenizer_class", "eos_token", "bos_token", "pad_token", "unk_token",
                               "chat_template", "vocab_size"}
    POST /tokenize         {"prompt": str, "add_special_tokens"?: true, "model"?} -> {"count", "tokens",
                                                                                       "max_model_len"}
    POST /detokenize       {"tokens": [int], "model"?} -> {"prompt": str}

Clients that count tokens themselves find them where they find vLLM's: lm-evaluation-harness's API models
(`tokenizer_backend=remote`, its default when these answer) need them for loglikelihood tasks against a
model name such as `name@N`, which names no tokenizer on the Hugging Face Hub. Every step of every model
shares the base model's tokenizer (training never changes it), so `model` is accepted and not needed.
Answered without the engine: they work while it starts or restarts.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ..http_body import parse_body
from ..state import get_state
from .tokenizer_service import TokenizerService

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20)
    model: str | None = None


def _tokenizer(request: Request) -> TokenizerService:
    return get_state(request).training.tokenizer


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The base model's special tokens and the chat template the engine serves with."""
    return await asyncio.to_thread(_tokenizer(request).info)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """The token ids of a prompt, as the engine reads a text prompt (`add_special_tokens` true)."""
    body = await parse_body(request, TokenizeRequest)
    tokens = await asyncio.to_thread(_tokenizer(request).encode, body.prompt,
                                     add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "tokens": tokens, "max_model_len": get_state(request).requests.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, str]:
    """The text of token ids, special tokens included."""
    body = await parse_body(request, DetokenizeRequest)
    return {"prompt": await asyncio.to_thread(_tokenizer(request).detokenize, body.tokens)}
