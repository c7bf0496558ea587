"""The email agent's tool-calling loop against scripted chat completions (the real openai SDK, a mock transport)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest

from examples.email_agent.agent import grade_result, initial_messages, run_agent
from examples.email_agent.data import EmailData, load_or_build
from examples.email_agent.records import Question
from examples.email_agent.reward import Verdict
from examples.email_agent.tools import TOOL_SPECS, EmailTools


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> EmailData:
    return load_or_build(tmp_path_factory.mktemp("email"), seed=5, inboxes=1, emails_per_inbox=80)


@pytest.fixture
def question(data: EmailData) -> Question:
    return next(q for q in data.corpus.questions if q.kind == "subject")


@pytest.fixture
def tools(data: EmailData, question: Question) -> Iterator[EmailTools]:
    with EmailTools(data.db_path, question.inbox) as tools:
        yield tools


def _completion(content: str | None = None, calls: Sequence[tuple[str, str]] = (), finish_reason: str = "stop") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish_reason}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}


class ScriptedServer:
    """Answers each chat completion request with the next scripted response and keeps the requests."""

    def __init__(self, responses: list[dict[str, Any]]) -> None:
        self.responses = list(responses)
        self.requests: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(json.loads(request.content))
        return httpx.Response(200, json=self.responses.pop(0))

    def client(self) -> openai.AsyncOpenAI:
        transport = httpx.MockTransport(self.handle)
        return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport))


async def test_invalid_calls_are_counted_answered_with_an_error_and_the_loop_goes_on(
    question: Question, tools: EmailTools
) -> None:
    source = question.source_ids[0]
    server = ScriptedServer([
        # 1. a tool call the server's parser missed (wrong closing tag): invalid, the model is told why
        _completion('<tool_call>\n{"name": "search_inbox", "arguments": {"keywords": "x"}}\n</tool_response>'),
        # 2. a proper search
        _completion(calls=[("search_inbox", json.dumps({"keywords": question.question}))]),
        # 3. plain text: invalid
        _completion("I think the answer is in the email."),
        # 4. a parsed call with an argument the tool does not take: invalid, error as the tool result
        _completion(calls=[("read_email", json.dumps({"message_id": source, "folder": "inbox"}))]),
        # 5. the answer
        _completion(calls=[("return_final_answer", json.dumps({"answer": question.answer, "sources": [source]}))]),
    ])
    result = await run_agent(server.client(), "m", question, tools, max_turns=6, temperature=0.0)

    assert (result.turns, result.tool_calls, result.invalid_tool_calls) == (5, 3, 3)
    assert (result.unparsed_tool_calls, result.text_replies, result.searches, result.reads) == (1, 1, 1, 0)
    assert result.final_answer == question.answer and result.sources == (source,)
    assert result.stop_reason == "answered"
    assert source in result.emails_found and not result.emails_read
    assert result.completion_tokens == 50
    new = result.messages[len(initial_messages(question)):]
    assert [m["role"] for m in new] == ["assistant", "user", "assistant", "tool", "assistant", "user",
                                        "assistant", "tool", "assistant", "tool"]
    assert new[1]["content"] == ("Error: your tool call could not be parsed: unexpected text after the JSON "
                                 "('</tool_response>'); end the call with </tool_call>.")
    assert new[5]["content"].startswith("Error: no tool call.")
    assert new[7]["content"] == "Error: invalid arguments for read_email: folder: unexpected argument"
    assert new[6]["tool_calls"][0]["function"]["name"] == "read_email"
    assert new[7]["tool_call_id"] == new[6]["tool_calls"][0]["id"]
    # Every request offered the tools and carried the whole conversation so far.
    assert all(r["tools"] == TOOL_SPECS and "tool_choice" not in r for r in server.requests)
    assert [len(r["messages"]) for r in server.requests] == [len(initial_messages(question)) + n for n in (0, 2, 4, 6, 8)]

    breakdown = await grade_result(question, result, max_turns=6)
    assert breakdown.verdict is Verdict.CORRECT
    assert breakdown.invalid == pytest.approx(-0.5)  # three invalid calls hit the floor


async def test_the_loop_stops_after_max_turns_without_an_answer(question: Question, tools: EmailTools) -> None:
    server = ScriptedServer([_completion('{"name": "search_inbox"'), _completion("hello"), _completion("hello")])
    result = await run_agent(server.client(), "m", question, tools, max_turns=3)
    assert (result.turns, result.final_answer, result.stop_reason) == (3, None, "max_turns")
    assert (result.invalid_tool_calls, result.unparsed_tool_calls, result.text_replies) == (3, 1, 2)
    first_feedback = result.messages[len(initial_messages(question)) + 1]
    assert first_feedback == {"role": "user", "content": "Error: your tool call could not be parsed: it is not valid JSON."}
    assert (await grade_result(question, result, max_turns=3)).verdict is Verdict.MISSING


async def test_truncated_tool_call_and_first_turn_tool_choice(question: Question, tools: EmailTools) -> None:
    named = {"type": "function", "function": {"name": "search_inbox"}}
    server = ScriptedServer([
        _completion(calls=[("search_inbox", '{"keywords": "budget"}')]),
        _completion('<tool_call>\n{"name": "return_final_answer", "arguments": {"answer": "a very long', finish_reason="length"),
    ])
    result = await run_agent(server.client(), "m", question, tools, max_turns=2, first_turn_tool_choice=named)
    assert server.requests[0]["tool_choice"] == named
    assert "tool_choice" not in server.requests[1]
    assert result.messages[-1]["content"] == ("Error: your tool call could not be parsed: it was cut off at the "
                                              "token limit; keep it short.")


async def test_api_errors_propagate(question: Question, tools: EmailTools) -> None:
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(500, json={"error": {"message": "engine died"}}))))
    with pytest.raises(openai.InternalServerError):
        await run_agent(client, "m", question, tools)


def test_worked_examples_are_valid_tool_calls(data: EmailData, question: Question) -> None:
    """The few-shot episodes must themselves be well-formed: every call parses and validates."""
    messages = initial_messages(question)
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user", "content": question.question}
    calls = [c for m in messages if m["role"] == "assistant" for c in m["tool_calls"]]
    assert [c["function"]["name"] for c in calls].count("return_final_answer") == 3
    with EmailTools(data.db_path, question.inbox) as tools:
        for call in calls:
            result = tools.dispatch(call["function"]["name"], call["function"]["arguments"])
            # ids of the examples are not in the corpus: reading one is the only allowed error
            assert result.ok or result.content.startswith("Error: read_email: no email with message_id")
