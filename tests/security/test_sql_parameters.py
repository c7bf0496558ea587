"""No SQL is built from a caller's string: a metadata filter key is bound as data, so quotes, unicode and
SQL fragments in it match exactly the records that carry that key, never change the query. In-process
over a real completion log, then the inbox and trajectory routes of the real server."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import orjson
import pytest
from artlike_server.completion_log import CompletionLog, NewCompletion
from artlike_server.completion_queries import CompletionFilter, newest_completions, parse_metadata_filter
from artlike_server.errors import InvalidRequest
from artlike_server.jobs.store import JobStore
from artlike_server.launcher import ServerProcess

from tests.unit.test_jobs_engine import spec

QUOTE = "it's"
SQL_KEY = "x'||(SELECT 6*7)||'"  # spliced into a quoted literal, this was the key "x42"
OLD_BREAKER = "a'"  # `metadata=a'=1`: a syntax error (500) when spliced
BOTH_QUOTES = 'say "hi" \\o/'
UNICODE = "ключ-été-🙂"
LONGEST = "k" * 63 + "🙂"  # 64 characters (67 bytes in UTF-8)


def new_completion(trajectory_id: str, metadata: dict[str, Any]) -> NewCompletion:
    return NewCompletion(
        trajectory_id=trajectory_id, request_id="chatcmpl-1", choice_index=0, endpoint="chat.completions",
        model="agent", served_model="agent@1", step=1,
        request=orjson.dumps({"model": "agent", "messages": [{"role": "user", "content": "hi"}],
                              "metadata": metadata}),
        prompt_token_ids=[1, 2], output_token_ids=[3], logprobs=[-0.5], finish_reason="stop",
        created_at=1_700_000_000.0, latency_seconds=0.1)


# Each trajectory's metadata; the decoys differ from a real key by what an injection or a lax match would
# confuse (the key the SQL fragment evaluates to, a prefix, another quote style, another normalisation).
RECORDS: dict[str, dict[str, Any]] = {
    "quote": {QUOTE: "1"},
    "sql": {SQL_KEY: "v"},
    "x42": {"x42": "v"},
    "breaker": {OLD_BREAKER: "1"},
    "both": {BOTH_QUOTES: "q"},
    "unicode": {UNICODE: "u"},
    "unicode-decomposed": {"ключ-e\u0301te\u0301-🙂": "u"},
    "longest": {LONGEST: "l"},
    "prefix": {LONGEST[:-1]: "l"},
    "numbers": {QUOTE: 1},  # a number is not the string "1"
    "none": {},
}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CompletionLog]:
    path: Path = tmp_path_factory.mktemp("sql") / "log.sqlite"
    with CompletionLog(path) as opened:
        opened.submit([new_completion(name, metadata) for name, metadata in RECORDS.items()]).result(timeout=30)
        yield opened


async def matching(log: CompletionLog, query: list[str]) -> set[str]:
    where = CompletionFilter(metadata=parse_metadata_filter(query))
    records = await log.read(partial(newest_completions, where=where, before=None, limit=100))
    return {record.trajectory_id for record in records}


@pytest.mark.parametrize(("query", "expected"), [
    ([f"{QUOTE}=1"], {"quote"}),
    ([f"{SQL_KEY}=v"], {"sql"}),
    ([f"{OLD_BREAKER}=1"], {"breaker"}),
    ([f"{BOTH_QUOTES}=q"], {"both"}),
    ([f"{UNICODE}=u"], {"unicode"}),
    ([f"{LONGEST}=l"], {"longest"}),
    ([f"{LONGEST[:-1]}=l"], {"prefix"}),
    (["x42=v"], {"x42"}),
    ([f"{QUOTE}=1", f"{SQL_KEY}=v"], set()),  # filters are ANDed
    ([f"{QUOTE}=2"], set()),
    (["x'||(SELECT count(*) FROM requests a,requests b,requests c)||'=1"], set()),
])
async def test_metadata_keys_are_matched_as_data(log: CompletionLog, query: list[str], expected: set[str]) -> None:
    assert await matching(log, query) == expected


@pytest.mark.parametrize("key", ["", " ", "k" * 65, "🙂" * 65])
def test_empty_or_too_long_keys_are_a_400(key: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_metadata_filter([f"{key}=v"])
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, "metadata", "invalid_filter")


def test_job_updates_take_only_known_columns(tmp_path: Path) -> None:
    # The one statement whose column names are formatted into the SQL: a name outside the table's fixed set
    # is refused before any SQL is built, whatever its text.
    store = JobStore(tmp_path)
    store.create("ftjob-a", spec(), training_file=None, validation_file=None, suffix=None, metadata=None,
                 train_rows=[{"prompt": "p"}], validation_rows=[])
    with pytest.raises(ValueError, match="not updatable"):
        store.update("ftjob-a", **{"status = 'succeeded', error": None})
    assert store.update("ftjob-a", status="running", stop_request=None).status == "running"
    store.close()


# --------------------------------------------------------------------------------- the real server


def completion_id(http: httpx.Client, model: str, metadata: dict[str, str]) -> int:
    trajectory = f"sql-test-{uuid4().hex[:10]}"
    response = http.post(f"/t/{trajectory}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "metadata": metadata})
    assert response.status_code == 200, response.text
    view = http.get(f"/v1/trajectories/{trajectory}/view").json()
    return int(view["completions"][0]["id"])


@pytest.mark.integration
def test_the_server_filters_by_any_key_and_refuses_bad_ones(http: httpx.Client, server: ServerProcess) -> None:
    tag = uuid4().hex  # this test's values: other tests' completions share the log
    keys = {"quote": QUOTE, "sql": SQL_KEY, "x42": "x42", "breaker": OLD_BREAKER, "both": BOTH_QUOTES,
            "unicode": UNICODE, "longest": LONGEST}
    ids = {name: completion_id(http, server.model_id, {key: tag}) for name, key in keys.items()}
    for name, key in keys.items():
        params = {"model": server.model_id, "metadata": f"{key}={tag}"}
        inbox = http.get("/v1/ratings/inbox", params=params)
        assert inbox.status_code == 200, inbox.text
        assert [item["completion_id"] for item in inbox.json()["data"]] == [ids[name]], name
        assert inbox.json()["data"][0]["metadata"] == {key: tag}
        trajectories = http.get("/v1/trajectories", params=params)
        assert trajectories.status_code == 200, trajectories.text
        assert [t["metadata"] for t in trajectories.json()["data"]] == [{key: tag}], name

    for bad in (f"={tag}", f"{'k' * 65}={tag}"):
        for route in ("/v1/ratings/inbox", "/v1/trajectories"):
            response = http.get(route, params={"metadata": bad})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "metadata",
                                                                      "invalid_filter")
