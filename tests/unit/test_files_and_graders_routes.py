"""`/v1/files` and `/v1/fine_tuning/alpha/graders/*` through the official `openai` SDK, over the routers
and services the server uses (an in-process ASGI app; the python grader runs in the real sandbox; the
score_model judge is a stand-in, since no engine runs here). Bodies validate against OpenAI's schemas."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from artlike_server.app import create_app
from artlike_server.jobs.datasets import (
    DatasetError,
    parse_chat_examples,
    parse_preference_rows,
    parse_prompt_rows,
)
from artlike_server.jobs.files import FileLimits, FileStore
from artlike_server.jobs.graders_service import GraderService
from artlike_server.jobs.intake import check_grade_source
from artlike_server.jobs.rewards import python_grader_runner
from artlike_server.jobs.sandbox import Sandbox, SandboxLimits

from tests.openapi_schema import assert_valid
from tests.unit.fake_services import fake_services


async def judge(messages: list[dict[str, Any]], model: str) -> str:
    return '{"result": 0.75}' if "Paris" in str(messages) else "no idea"


@pytest.fixture
async def app_parts(tmp_path: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient, FileStore]]:
    sandbox = Sandbox(tmp_path / "sandbox", limits=SandboxLimits(call_timeout_s=5, workers=1))
    files = FileStore(tmp_path / "files", FileLimits(max_bytes=4096, max_lines=5))
    app = create_app(fake_services(files=files, graders=GraderService(
        python_grader_runner(sandbox), judge, check_source=check_grade_source)))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="k", max_retries=0, http_client=http)
    yield client, http, files
    await http.aclose()
    await sandbox.close()


ROWS = b'{"prompt": "What is AI?", "expected_result": "Artificial Intelligence"}\n{"prompt": "Define ML"}\n'


async def test_files_through_the_sdk(app_parts: Any, tmp_path: Path) -> None:
    client, http, _ = app_parts
    created = await client.files.create(file=("rows.jsonl", io.BytesIO(ROWS)), purpose="fine-tune")
    assert_valid("OpenAIFile", created.model_dump(mode="json", exclude_none=True))
    assert (created.bytes, created.filename, created.purpose) == (len(ROWS), "rows.jsonl", "fine-tune")
    twin = await client.files.create(file=("same.jsonl", io.BytesIO(ROWS)), purpose="fine-tune")
    assert len(list((tmp_path / "files" / "blobs").iterdir())) == 1  # one blob for identical content
    assert (await client.files.retrieve(created.id)).id == created.id
    assert (await client.files.content(created.id)).read() == ROWS
    listed = await http.get("/v1/files", params={"limit": 1})
    assert_valid("ListFilesResponse", listed.json())
    assert listed.json()["has_more"] is True
    page = [f.id async for f in client.files.list(purpose="fine-tune")]
    assert set(page) == {created.id, twin.id}
    deleted = await client.files.delete(created.id)
    assert_valid("DeleteFileResponse", deleted.model_dump(mode="json"))
    assert len(list((tmp_path / "files" / "blobs").iterdir())) == 1  # still used by the twin
    await client.files.delete(twin.id)
    assert list((tmp_path / "files" / "blobs").iterdir()) == []
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(created.id)
    reopened = FileStore(tmp_path / "files")
    assert reopened.page()[0] == []


@pytest.mark.parametrize(("content", "status", "fragment"), [
    (b'{"prompt": "ok"}\n[1, 2]\n', 400, "line 2"),
    (b'{"prompt": "ok"}\n{nope\n', 400, "line 2"),
    (b"\n\n", 400, "no rows"),
    (b"\xff\xfe", 400, "UTF-8"),
    (b'{"a": 1}\n' * 6, 413, "more than 5 lines"),
    (b'{"a": "' + b"x" * 5000 + b'"}\n', 413, "bytes"),
])
async def test_bad_uploads_are_refused_with_the_line(app_parts: Any, content: bytes, status: int, fragment: str) -> None:
    _, http, files = app_parts
    response = await http.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("f.jsonl", content)})
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]
    assert files.page()[0] == []


async def test_upload_needs_a_file_and_a_known_purpose(app_parts: Any) -> None:
    _, http, _ = app_parts
    assert (await http.post("/v1/files", data={"purpose": "fine-tune"})).json()["error"]["param"] == "file"
    bad = await http.post("/v1/files", data={"purpose": "nonsense"}, files={"file": ("f.jsonl", ROWS)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "purpose"


async def test_graders_run_through_the_sdk(app_parts: Any) -> None:
    client, _, _ = app_parts
    graders = client.fine_tuning.alpha.graders
    checked = await graders.run(grader={"type": "string_check", "name": "s", "input": "{{sample.output_text}}",
                                        "reference": "{{item.label}}", "operation": "ilike"},
                                model_sample="PARIS", item={"label": "paris"})
    assert_valid("RunGraderResponse", checked.model_dump(mode="json"))
    assert checked.reward == 1.0 and not any(v for k, v in checked.metadata.errors.model_dump().items()
                                             if isinstance(v, bool))
    multi = await graders.run(grader={"type": "multi", "name": "m", "calculate_output": "0.5 * py + 0.5 * judge",
                                      "graders": {
                                          "py": {"type": "python", "name": "py",
                                                 "source": "def grade(sample, item):\n"
                                                           "    return float(sample['output_text'] == item['label'])\n"},
                                          "judge": {"type": "score_model", "name": "judge", "model": "any",
                                                    "input": [{"role": "user", "content": "{{sample.output_text}}"}]}}},
                              model_sample="Paris", item={"label": "Paris"})
    assert multi.reward == pytest.approx(0.875) and multi.sub_rewards == {"py": 1.0, "judge": 0.75}
    broken = await graders.run(grader={"type": "python", "name": "p",
                                       "source": "def grade(sample, item):\n    return item['missing']\n"},
                               model_sample="x", item={})
    assert broken.reward == 0.0 and broken.metadata.errors.python_grader_runtime_error
    details = broken.metadata.errors.python_grader_runtime_error_details or ""
    assert "KeyError" in details and "line 2" in details


async def test_graders_validate(app_parts: Any) -> None:
    client, http, _ = app_parts
    grader = {"type": "text_similarity", "name": "t", "input": "{{sample.output_text}}",
              "reference": "{{item.ref}}", "evaluation_metric": "bleu"}
    valid = await client.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
    assert_valid("ValidateGraderResponse", valid.model_dump(mode="json", exclude_none=True))
    bad = await http.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": {**grader, "evaluation_metric": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("grader.")
    syntax = await http.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": {
        "type": "python", "name": "p", "source": "def grade(sample, item)\n    return 1\n"}})
    assert syntax.status_code == 400 and "line 1" in syntax.json()["error"]["message"]
    missing = await http.post("/v1/fine_tuning/alpha/graders/run", json={"grader": grader})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_sample"


# ------------------------------------------------------------------------------------------ datasets


def test_prompt_rows_of_each_kind() -> None:
    rows = parse_prompt_rows(b'{"prompt": "Hi", "expected_result": "Hello", "target_length": 5}\n\n'
                             b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],'
                             b' "reference_answer": "28", "tools": [{"type": "function", "function": {"name": "f"}}]}\n')
    assert [r.line for r in rows] == [1, 3]
    assert rows[0].messages == [{"role": "user", "content": "Hi"}]
    assert rows[0].item == {"prompt": "Hi", "expected_result": "Hello", "target_length": 5}
    assert rows[1].item["reference_answer"] == "28" and rows[1].tools and rows[1].tools[0]["function"]["name"] == "f"
    inline = parse_prompt_rows([{"prompt": "a"}, {"prompt": "b", "x": 1}])
    assert [r.line for r in inline] == [1, 2] and inline[1].item == {"prompt": "b", "x": 1}


@pytest.mark.parametrize(("content", "line", "field"), [
    (b'{"prompt": "ok"}\n{"expected_result": "no prompt"}\n', 2, "prompt"),
    (b'{"prompt": ""}\n', 1, "prompt"),
    (b'{"messages": []}\n', 1, "messages"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}\n', 1, "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 3}]}\n', 1, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n', 1, "messages"),
    (b'{"prompt": "a", "messages": [{"role": "user", "content": "q"}]}\n', 1, "prompt"),
    (b'{"prompt": "a", "tools": [{"type": "function"}]}\n', 1, "tools"),
    (b'{"prompt": "a"}\n{"prompt": "b"}\n{oops\n', 3, None),
])
def test_prompt_row_errors_name_the_line_and_field(content: bytes, line: int, field: str | None) -> None:
    with pytest.raises(DatasetError) as error:
        parse_prompt_rows(content)
    assert error.value.line == line and error.value.field == field
    assert str(error.value).startswith(f"line {line}: ")


def test_supervised_and_preference_rows() -> None:
    chat = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    assert parse_chat_examples(chat)[0]["messages"][-1] == {"role": "assistant", "content": "a"}
    with pytest.raises(DatasetError, match="no assistant"):
        parse_chat_examples(b'{"messages": [{"role": "user", "content": "q"}]}\n')
    pair = (b'{"input": {"messages": [{"role": "user", "content": "q"}]}, '
            b'"preferred_output": [{"role": "assistant", "content": "good"}], '
            b'"non_preferred_output": [{"role": "assistant", "content": "bad"}]}\n')
    parsed = parse_preference_rows(pair)[0]
    assert parsed["prompt"] == [{"role": "user", "content": "q"}]
    assert parsed["chosen"][0]["content"] == "good" and parsed["rejected"][0]["content"] == "bad"
    with pytest.raises(DatasetError) as error:
        parse_preference_rows(b'{"input": {"messages": [{"role": "user", "content": "q"}]}}\n')
    assert error.value.field == "preferred_output"
    with pytest.raises(DatasetError, match="no rows"):
        parse_prompt_rows(b"")
