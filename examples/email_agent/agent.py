"""The email agent: an OpenAI tool-calling loop, bounded in turns, that works with any OpenAI-compatible API.

    result = await run_agent(openai.AsyncOpenAI(base_url=...), "my-model", question, tools, max_turns=5)
    result.final_answer, result.sources, result.turns, result.invalid_tool_calls

Each turn is one chat completion with the three tools offered. Tool calls run through `EmailTools.dispatch`
and their results go back as `tool` messages. A reply without a parsed tool call is an invalid tool call:
a `<tool_call>` block or bare JSON the server's parser missed, a reply cut off at the token limit, or plain
text. It is counted, the model is told what went wrong in a `user` message, and the loop goes on. The loop
ends when the model calls `return_final_answer` (with valid arguments) or after `max_turns` model calls.

The prompt is built for small models: a short system message and three worked episodes written as real
prior tool-call turns (with an instruction alone the 135M model does not use the answer format).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import openai
from openai.types.chat import ChatCompletionMessageFunctionToolCall as FunctionToolCall

from examples.email_agent.records import Question
from examples.email_agent.reward import (
    DEFAULT_WEIGHTS,
    AsyncJudge,
    RewardBreakdown,
    RewardWeights,
    TrajectoryStats,
    grade,
    grade_with_async_judge,
)
from examples.email_agent.tools import (
    TOOL_SPECS,
    EmailTools,
    EmailView,
    SearchHit,
    format_email,
    format_search_hits,
)

DEFAULT_MAX_TURNS = 5
DEFAULT_MAX_TOKENS = 100  # per turn: a tool call takes 20-50 tokens; more is rambling

SYSTEM_PROMPT = (
    "You answer questions about the user's email inbox with tools. Search with a few keywords from the "
    "question, read the most promising email, then call return_final_answer with the exact fact (a name, "
    "time, date, amount or code) and the message ids of the emails that state it. If you cannot find it, "
    "answer \"I don't know\". Every reply must be a tool call."
)


def _tool_call_message(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    # json.dumps spacing, as vLLM's tool parsers write `arguments`: the examples look like real history.
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _worked_example(tag: str, question: str, steps: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    """A user question, then each (tool, arguments, tool result) as a real assistant tool call and tool reply."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for n, (name, arguments, result) in enumerate(steps, start=1):
        call_id = f"call_{tag}_{n}"
        messages += [_tool_call_message(call_id, name, arguments),
                     {"role": "tool", "tool_call_id": call_id, "content": result}]
    return messages


_TRIP = EmailView(
    message_id="ex00417", sent_at="2024-02-05T10:15:00", from_addr="trips@skywaytravel.com",
    to_addrs="sam.lee@example.com", cc="", subject="Trip confirmation: Reykjavik", attachments="",
    body="Hi Sam,\n\nYour flight FI 614 from BOS to Reykjavik departs at 9:40 AM on Monday, February 12. "
         "Confirmation code: KZ4M7Q. Hotel: The Linden, 3 nights.\n\nSkyway Travel")
_RECORDED = "Answer recorded."

# Three short episodes in the real tool-call format, on made-up names the corpus never uses. One example
# was not enough for the 135M model (0 of 32 sampled first turns were tool calls); three gave 25 of 32.
WORKED_EXAMPLES: list[dict[str, Any]] = [
    *_worked_example("a", "What time is the Falcon demo?", [
        ("search_inbox", {"keywords": "Falcon demo"}, format_search_hits([
            SearchHit("ex00102", "2024-01-09", "li.wu@example.com", "Falcon demo moved to 2:30 PM",
                      "…the Falcon demo is now on Friday, January 12 at 2:30 PM in Room 2B…"),
            SearchHit("ex00087", "2024-01-03", "li.wu@example.com", "Notes: Falcon demo",
                      "Notes from today's Falcon demo: the team is heads down…")])),
        ("return_final_answer", {"answer": "2:30 PM", "sources": ["ex00102"]}, _RECORDED)]),
    *_worked_example("b", "What is the confirmation code for my trip to Reykjavik?", [
        ("search_inbox", {"keywords": "Reykjavik trip confirmation"}, format_search_hits([
            SearchHit(_TRIP.message_id, "2024-02-05", _TRIP.from_addr, _TRIP.subject,
                      "…flight FI 614 from BOS to Reykjavik departs at 9:40 AM on…")])),
        ("read_email", {"message_id": _TRIP.message_id}, format_email(_TRIP)),
        ("return_final_answer", {"answer": "KZ4M7Q", "sources": [_TRIP.message_id]}, _RECORDED)]),
    *_worked_example("c", "Which vendor was chosen for the Kite hosting work?", [
        ("search_inbox", {"keywords": "Kite hosting vendor"}, format_search_hits([
            SearchHit("ex00388", "2024-04-18", "mo.ali@example.com", "Decision: Bluecloud for Kite hosting",
                      "…we're going with Bluecloud for hosting on Kite…")])),
        ("return_final_answer", {"answer": "Bluecloud", "sources": ["ex00388"]}, _RECORDED)]),
]


def initial_messages(question: Question) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, *WORKED_EXAMPLES,
            {"role": "user", "content": question.question}]


@dataclass
class AgentResult:
    messages: list[dict[str, Any]]
    final_answer: str | None = None
    sources: tuple[str, ...] = ()
    turns: int = 0  # model calls
    tool_calls: int = 0  # parsed tool calls that were run (valid or not)
    invalid_tool_calls: int = 0  # bad tool calls + replies without a parsed tool call
    unparsed_tool_calls: int = 0  # of those: a tool call written into the text
    text_replies: int = 0  # of those: plain text, no tool call at all
    searches: int = 0
    reads: int = 0
    emails_found: set[str] = field(default_factory=set)
    emails_read: set[str] = field(default_factory=set)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: Literal["answered", "max_turns"] = "max_turns"

    def stats(self, max_turns: int) -> TrajectoryStats:
        return TrajectoryStats(turns=self.turns, max_turns=max_turns, invalid_tool_calls=self.invalid_tool_calls,
                               emails_found=frozenset(self.emails_found), emails_read=frozenset(self.emails_read))

    @property
    def attempted_tool_calls(self) -> int:
        return self.tool_calls + self.unparsed_tool_calls + self.text_replies

    def metrics(self) -> dict[str, float]:
        return {
            "turns": float(self.turns),
            "tool_calls": float(self.tool_calls),
            "invalid_tool_calls": float(self.invalid_tool_calls),
            "invalid_tool_call_rate": self.invalid_tool_calls / max(1, self.attempted_tool_calls),
            "unparsed_tool_calls": float(self.unparsed_tool_calls),
            "text_replies": float(self.text_replies),
            "searches": float(self.searches),
            "reads": float(self.reads),
            "answered": float(self.final_answer is not None),
            "completion_tokens": float(self.completion_tokens),
        }


async def run_agent(
    client: openai.AsyncOpenAI,
    model: str,
    question: Question,
    tools: EmailTools,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
    temperature: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    first_turn_tool_choice: str | dict[str, Any] | None = None,
    tool_choice: str | None = None,
) -> AgentResult:
    """Run the agent on one question. API errors (connection, 4xx/5xx) propagate; model mistakes do not.

    `first_turn_tool_choice` ("required" or {"type": "function", "function": {"name": ...}}) forces a tool
    call on the first turn through the server's structured output; later turns use `tool_choice` ("auto"
    when None; "required": every reply is a valid call of one of the tools, by structured output).
    """
    result = AgentResult(messages=initial_messages(question))
    while result.final_answer is None and result.turns < max_turns:
        request: dict[str, Any] = {"model": model, "messages": result.messages, "tools": TOOL_SPECS,
                                   "temperature": temperature, "max_tokens": max_tokens}
        if result.turns == 0 and first_turn_tool_choice is not None:
            request["tool_choice"] = first_turn_tool_choice
        elif tool_choice is not None:
            request["tool_choice"] = tool_choice
        response = await client.chat.completions.create(**request)
        result.turns += 1
        if response.usage is not None:
            result.prompt_tokens += response.usage.prompt_tokens
            result.completion_tokens += response.usage.completion_tokens
        choice = response.choices[0]
        message = choice.message
        calls = [c for c in message.tool_calls or [] if isinstance(c, FunctionToolCall)]
        result.messages.append(_assistant_message(message.content, calls))
        if not calls:
            _handle_reply_without_tool_call(result, message.content or "", choice.finish_reason)
            continue
        for call in calls:
            if _run_tool_call(result, tools, call):
                break
    if result.final_answer is not None:
        result.stop_reason = "answered"
    return result


def _assistant_message(content: str | None, calls: list[FunctionToolCall]) -> dict[str, Any]:
    # A message without tool calls needs string content for chat templates that concatenate it.
    message: dict[str, Any] = {"role": "assistant", "content": content if calls else content or ""}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in calls]
    return message


def _run_tool_call(result: AgentResult, tools: EmailTools, call: FunctionToolCall) -> bool:
    """Run one parsed tool call; True when it delivered the final answer."""
    outcome = tools.dispatch(call.function.name, call.function.arguments)
    result.messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome.content})
    result.tool_calls += 1
    if not outcome.ok:
        result.invalid_tool_calls += 1
        return False
    if call.function.name == "search_inbox":
        result.searches += 1
        result.emails_found.update(outcome.message_ids)
    elif call.function.name == "read_email":
        result.reads += 1
        result.emails_read.update(outcome.message_ids)
    if outcome.final_answer is not None:
        result.final_answer = outcome.final_answer.answer
        result.sources = outcome.final_answer.sources
        return True
    return False


_TOOL_CALL_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _handle_reply_without_tool_call(result: AgentResult, content: str, finish_reason: str | None) -> None:
    # Short feedback without tool-call syntax in it: small models parrot whatever markup they are shown.
    result.invalid_tool_calls += 1
    stripped = content.strip()
    if "<tool_call>" in stripped or stripped.startswith(("{", "[", "```")):
        result.unparsed_tool_calls += 1
        feedback = f"Error: your tool call could not be parsed: {_diagnose_written_tool_call(stripped, finish_reason)}."
    else:
        result.text_replies += 1
        feedback = "Error: no tool call. Reply with a tool call; to answer, call return_final_answer."
    result.messages.append({"role": "user", "content": feedback})


def _diagnose_written_tool_call(content: str, finish_reason: str | None) -> str:
    if finish_reason == "length":
        return "it was cut off at the token limit; keep it short"
    tagged = _TOOL_CALL_TAG.search(content)
    payload = (tagged.group(1) if tagged else content).strip().strip("`").removeprefix("json").strip()
    try:
        call, end = json.JSONDecoder().raw_decode(payload)
    except json.JSONDecodeError:
        return "it is not valid JSON"
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        return 'it needs the keys "name" and "arguments"'
    if not isinstance(call["arguments"], dict):
        return '"arguments" must be a JSON object'
    if payload[end:].strip():
        return f"unexpected text after the JSON ({payload[end:].strip()[:20]!r}); end the call with </tool_call>"
    return "write it inside <tool_call></tool_call> tags"


async def grade_result(
    question: Question,
    result: AgentResult,
    max_turns: int,
    judge: AsyncJudge | None = None,
    weights: RewardWeights = DEFAULT_WEIGHTS,
) -> RewardBreakdown:
    """The reward of one agent run: `reward.grade` on its final answer and what it searched and read."""
    stats = result.stats(max_turns)
    if judge is None:
        return grade(question, result.final_answer, result.sources, stats, weights=weights)
    return await grade_with_async_judge(question, result.final_answer, result.sources, stats, judge, weights)
