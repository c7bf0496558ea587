"""One way in for request bodies (`artlike_server.http_body`): JSON whatever the Content-Type, validated by
pydantic, every failure a 400 in the OpenAI shape naming its parameter — the helper alone, then through
routers (studio ratings, trainable models, training sessions) with stand-in services."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import httpx
import pytest
from artlike_server.errors import InvalidRequest, install_error_handlers
from artlike_server.http_body import parse_json, read_json, validate
from artlike_server.models.api_router import router as models_router
from artlike_server.studio.router import router as studio_router
from artlike_server.training.api_router import parse_train_request
from artlike_server.training.sessions_router import router as sessions_router
from fastapi import FastAPI
from pydantic import BaseModel, Field, TypeAdapter

from artlike.session_types import SaveStateRequest
from artlike.studio_types import Rating
from artlike.types import LoraConfig, ModelInfo, RegisterModelRequest, SetAliasRequest


class Inner(BaseModel):
    count: int = Field(ge=1)


class Outer(BaseModel):
    name: str
    inner: Inner


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]


PET = TypeAdapter(Annotated[Cat | Dog, Field(discriminator="kind")])


def raised(call: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        call()
    assert caught.value.status_code == 400
    return caught.value


def test_a_valid_body_is_parsed_into_its_model() -> None:
    assert parse_json(b'{"name": "a", "inner": {"count": 2}}', Outer) == Outer(name="a", inner=Inner(count=2))
    assert parse_json(b'{"kind": "cat", "lives": 9}', PET) == Cat(kind="cat", lives=9)
    assert validate({"name": "a", "inner": {"count": 1}}, Outer).inner.count == 1


def test_a_body_that_is_not_json_is_invalid_json() -> None:
    for call in (lambda: read_json(b"{nope"), lambda: parse_json(b"{nope", Outer)):
        error = raised(call)
        assert error.code == "invalid_json" and error.param is None
        assert "not valid JSON" in error.message


def test_a_validation_error_names_the_nested_parameter() -> None:
    error = raised(lambda: parse_json(b'{"name": "a", "inner": {"count": 0}}', Outer))
    assert (error.param, error.code) == ("inner.count", "invalid_value")
    assert error.message.startswith("inner.count: ")
    assert raised(lambda: validate({"inner": {"count": 1}}, Outer)).param == "name"
    assert raised(lambda: validate({"name": "a"}, Outer, prefix="grader")).param == "grader.inner"


def test_a_missing_or_unknown_union_tag_names_the_tag_field() -> None:
    missing = raised(lambda: parse_json(b'{"lives": 9}', PET))
    assert missing.param == "kind" and missing.message == "kind: Field required"
    unknown = raised(lambda: parse_json(b'{"kind": "cow"}', PET))
    assert unknown.param == "kind" and "'cat', 'dog'" in unknown.message
    inside = raised(lambda: parse_json(b'{"kind": "cat", "lives": "many"}', PET))
    assert inside.param == "cat.lives"  # pydantic's own location, tag included, for an error inside a member


def test_the_train_request_names_the_field_the_caller_sent() -> None:
    error = raised(lambda: parse_train_request(
        b'{"model": "m", "groups": [], "config": {"objective": "sft", "learning_rate": -1}}'))
    assert error.param == "config.learning_rate"


# ----------------------------------------------------------------------------------------- routes


RATING = Rating(id=7, completion_id=3, trajectory_id="t", model="m", step=0, kind="thumb", value="up", reward=1.0,
                rater="api", split="train", created_at=0.0)
MODEL = ModelInfo(name="m", base_model="base", lora=LoraConfig(), latest_step=0, newest_step=0, served_name="m",
                  created_at=0.0, steps=[])


class Recorder:
    """Stand-in services: each records the request model it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def rate(self, body: Any, *, default_rater: str) -> list[Rating]:
        self.calls.append(("rate", body))
        return [RATING]

    async def register(self, body: RegisterModelRequest) -> tuple[ModelInfo, bool]:
        self.calls.append(("register", body))
        return MODEL, True

    async def set_alias(self, name: str, body: SetAliasRequest) -> ModelInfo:
        self.calls.append(("set_alias", body))
        return MODEL

    async def save_state(self, session_id: str, body: SaveStateRequest) -> dict[str, Any]:
        self.calls.append(("save_state", body))
        return {"model": "m@1", "step": 1, "adapter_path": "/a", "served": body.serve, "seconds": 0.0}


@pytest.fixture
async def routes() -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
    app = FastAPI()
    install_error_handlers(app)
    for router in (studio_router, models_router, sessions_router):
        app.include_router(router)
    services = Recorder()
    app.state.artlike = SimpleNamespace(ratings=services, registry=services, sessions=services)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client, services


def openai_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


async def test_a_rating_without_kind_names_kind(routes: tuple[httpx.AsyncClient, Recorder]) -> None:
    client, services = routes
    error = openai_error(await client.post("/v1/ratings", json={"completion_id": 3, "value": "up"}))
    assert error["param"] == "kind" and "discriminator" not in error["message"]
    error = openai_error(await client.post("/v1/ratings", json={"kind": "stars", "completion_id": 3}))
    assert error["param"] == "kind"
    assert services.calls == []  # refused before any service was called


async def test_a_json_body_is_taken_whatever_its_content_type(routes: tuple[httpx.AsyncClient, Recorder]) -> None:
    client, services = routes
    form = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d '{...}'` sends
    rated = await client.post("/v1/ratings", content=b'{"kind": "thumb", "completion_id": 3, "value": "up"}',
                              headers=form)
    assert rated.status_code == 201 and rated.json()["data"][0]["id"] == 7
    registered = await client.post("/v1/trainable_models", content=b'{"name": "m", "base_model": "base"}',
                                   headers=form)
    assert registered.status_code == 201 and registered.json()["name"] == "m"
    moved = await client.post("/v1/trainable_models/m/alias", content=b'{"step": 0}', headers={})
    assert moved.status_code == 200
    assert [name for name, _ in services.calls] == ["rate", "register", "set_alias"]
    assert services.calls[1][1] == RegisterModelRequest(name="m", base_model="base")


async def test_route_errors_name_the_parameter(routes: tuple[httpx.AsyncClient, Recorder]) -> None:
    client, _ = routes
    assert openai_error(await client.post("/v1/trainable_models/m/alias", json={"step": -1}))["param"] == "step"
    error = openai_error(await client.post("/v1/trainable_models", content=b"name=m", headers={
        "content-type": "application/x-www-form-urlencoded"}))
    assert error["code"] == "invalid_json"
    assert openai_error(await client.post("/v1/trainable_models"))["code"] == "invalid_json"  # empty body


async def test_an_optional_body_may_be_left_out(routes: tuple[httpx.AsyncClient, Recorder]) -> None:
    client, services = routes
    assert (await client.post("/v1/training_sessions/s1/save_state")).status_code == 201
    assert (await client.post("/v1/training_sessions/s1/save_state", json={"serve": False})).status_code == 201
    assert [body for _, body in services.calls] == [SaveStateRequest(), SaveStateRequest(serve=False)]
