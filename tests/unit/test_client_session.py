"""`art.TrainingSession`'s client side against an in-process mock server: queued `_async` calls reach the
server in the order they were made, bodies are validated before sending, and leaving the `async with` of a
session the server already ended is quiet. The real primitives run in tests/integration/test_training_sessions.py."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from pydantic import ValidationError

import artlike as art
from artlike.session_types import AdamParams, PassResult, SessionInfo

SERVER = "http://artlike.test"


def session_info(status: str = "open") -> dict[str, object]:
    return SessionInfo(id="ts_1", model="agent", step=0, created_at=1.0, last_used_at=1.0, idle_timeout_s=600,
                       optimizer=AdamParams(), optimizer_steps=0, pending_passes=0,
                       status=status).model_dump(mode="json")  # type: ignore[arg-type]


def pass_result(tokens: int) -> dict[str, object]:
    return PassResult(loss=0.5, tokens=tokens, objective="sft", metrics={}, sequences=[], pending_passes=1,
                      seconds=0.0).model_dump(mode="json")


async def test_queued_calls_reach_the_server_in_order_and_bodies_are_checked_first() -> None:
    seen: list[tuple[str, object]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else None
        if request.url.path == "/v1/training_sessions":
            assert body["optimizer"]["learning_rate"] == 1e-4  # type: ignore[index]
            return httpx.Response(201, json=session_info())
        if request.method == "DELETE":
            seen.append(("close", None))
            return httpx.Response(404, json={"error": {"message": "gone", "type": "not_found_error",
                                                       "param": "id", "code": "session_not_found"}})
        action = request.url.path.rsplit("/", 1)[-1]
        tokens = len(body["sequences"][0]["token_ids"]) if body and body.get("sequences") else 0  # type: ignore[union-attr]
        await asyncio.sleep(0.05 if tokens == 2 else 0.0)  # the first call is the slowest
        seen.append((action, tokens))
        if action == "optim_step":
            return httpx.Response(200, json={"grad_norm": 1.0, "optimizer_steps": 1, "learning_rate": 1e-4,
                                             "seconds": 0.0})
        return httpx.Response(200, json=pass_result(tokens))

    model = art.TrainableModel("agent", "base/model", SERVER, transport=httpx.MockTransport(handler))
    async with await model.training_session(learning_rate=1e-4) as session:
        first = session.forward_backward_async([{"token_ids": [1, 2]}])
        second = session.forward_backward_async([{"token_ids": [1, 2, 3]}])
        step = session.optim_step_async()
        third = session.forward_async([{"token_ids": [1, 2, 3, 4]}])
        results = await asyncio.gather(first, second, step, third)
        assert [r.tokens for r in (results[0], results[1], results[3])] == [2, 3, 4]
        with pytest.raises(ValidationError):  # misaligned: refused before any request
            await session.forward_backward([{"token_ids": [1, 2], "trainable": [True]}])
        with pytest.raises(ValidationError):  # not a DPO option
            await session.forward_backward([{"token_ids": [1, 2]}], loss="dpo", bta=0.1)
    assert seen == [("forward_backward", 2), ("forward_backward", 3), ("optim_step", 0), ("forward", 4),
                    ("close", None)]  # and the 404 of a session that already ended is not raised
