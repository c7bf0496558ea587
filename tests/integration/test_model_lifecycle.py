"""Registration against the real server: bad LoRA targets are 400s that leave nothing behind; the step
retention policy is set at registration and changed with PATCH."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from artlike_server.launcher import ServerProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("targets", [["embed_tokens"], ["nonexistent_proj"], ["model.norm"], ["q_proj", "lm_head"]])
def test_unservable_target_modules_are_a_400_naming_the_parameter(server: ServerProcess, targets: list[str]) -> None:
    name = f"bad-{uuid.uuid4().hex[:8]}"
    response = httpx.post(f"{server.base_url}/v1/trainable_models", headers=server.headers, timeout=60, json={
        "name": name, "base_model": server.model_id, "lora": {"rank": 8, "target_modules": targets}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora.target_modules" and error["code"] == "invalid_target_modules"
    assert "q_proj" in error["message"]  # the servable choices are listed
    assert not (Path(server.data_dir) / "models" / name).exists()  # nothing half-registered
    assert httpx.get(f"{server.base_url}/v1/trainable_models/{name}", headers=server.headers).status_code == 404


def test_retention_is_set_at_registration_and_changed_with_patch(server: ServerProcess) -> None:
    name = f"kept-{uuid.uuid4().hex[:8]}"
    url = f"{server.base_url}/v1/trainable_models"
    created = httpx.post(url, headers=server.headers, timeout=300, json={
        "name": name, "base_model": server.model_id, "retention": {"keep_last": 3}})
    assert created.status_code == 201, created.text
    assert created.json()["retention"] == {"keep_last": 3, "keep_best": None}
    patched = httpx.patch(f"{url}/{name}", headers=server.headers, timeout=60, json={
        "retention": {"keep_best": {"metric": "reward.mean", "mode": "max", "count": 2}}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["retention"]["keep_best"] == {"metric": "reward.mean", "mode": "max", "count": 2}
    assert httpx.get(f"{url}/{name}", headers=server.headers).json()["retention"] == patched.json()["retention"]
    bad = httpx.patch(f"{url}/{name}", headers=server.headers, json={"retention": {"keep_last": 0}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "retention.keep_last"
    assert httpx.patch(f"{url}/no-such-model", headers=server.headers,
                       json={"retention": {"keep_last": 1}}).status_code == 404
