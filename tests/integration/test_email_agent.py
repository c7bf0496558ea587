"""The email agent example against the real server: a multi-turn tool-calling trajectory, recorded token-exact,
then one GRPO step on its group, then a rollout served by the new step.

Uses the session fixture `capable_server` (tests/conftest.py: `.base_url`, `.model_id`, `.api_key`), which
serves the full default model with the tool-capable ChatML template and the hermes tool-call parser."""

from __future__ import annotations

from uuid import uuid4

import pytest
from artlike_server.launcher import ServerProcess

import artlike as art
from examples.email_agent.data import EmailData, load_or_build
from examples.email_agent.records import Question
from examples.email_agent.rollout import rollout
from examples.email_agent.tools import TOOL_SPECS

from .helpers import trainable_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(capable_server: ServerProcess) -> ServerProcess:
    """Search calls that find mail (else every reward ties): the full embedded model."""
    return capable_server

# Forcing the first call through the server's structured output makes the model write a search_inbox call,
# whatever the 135M model would have written on its own. Its arguments are still sampled: at temperature 1 they
# are sometimes invalid (extra keys), and the tool then answers with an error message; and now and then a call
# rambles in a string value past the token limit (most take 30-60 tokens, a few up to 80), so the cut-off call
# does not parse and the agent answers with its "could not be parsed" feedback instead. Either way there is a
# second turn.
FORCE_SEARCH = {"type": "function", "function": {"name": "search_inbox"}}
REWARD_METRICS = {"reward/answer", "reward/sources", "reward/found", "reward/read", "reward/turns", "reward/invalid",
                  "turns", "invalid_tool_calls", "answer_correct", "sources_correct"}
GROUP_SIZE = 3  # the 1,450-token prompt plus 3-4 sequences fit one micro-batch: the prompt is trained once
MAX_TURNS = 2  # the forced search, then one free turn: multi-turn, and a short sequence to train on
MAX_TOKENS = 64  # per turn: room for most forced calls; the free turn's rambling is cut short
MAX_ATTEMPTS = 3
AFTER_TOKENS = 12  # the rollout served by the trained step: a few tokens of its first turn
# What search_inbox answers: hits, no hits, or the error for arguments that do not validate.
SEARCH_REPLIES = ("[", "No emails matched", "Error: invalid arguments for search_inbox", "Error: search_inbox:")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> EmailData:
    return load_or_build(tmp_path_factory.mktemp("email"), seed=0, inboxes=1, emails_per_inbox=120)


def _question(data: EmailData) -> Question:
    return next(q for q in data.corpus.split("train") if q.kind == "subject")


async def _group(model: art.TrainableModel, question: Question, data: EmailData) -> art.TrajectoryGroup:
    [group] = await art.gather_trajectory_groups([art.TrajectoryGroup(
        rollout(model, question, data.db_path, max_turns=MAX_TURNS, temperature=1.0, max_tokens=MAX_TOKENS,
                first_turn_tool_choice=FORCE_SEARCH)
        for _ in range(GROUP_SIZE))])
    return group


async def test_email_agent_records_multi_turn_trajectories_and_trains(server: ServerProcess, data: EmailData) -> None:
    question = _question(data)
    model = trainable_model(server, f"email-{uuid4().hex[:10]}")
    async with model:
        await model.register()

        # Rewards vary between samples at temperature 1 (turns, invalid calls, answers); in the rare group
        # where all of them tie there is nothing to learn, so roll the group again.
        for _ in range(MAX_ATTEMPTS):
            group = await _group(model, question, data)
            if len(set(group.rewards)) > 1:
                break
        trajectories = list(group)
        assert len(trajectories) == GROUP_SIZE
        assert len(set(group.rewards)) > 1, f"{MAX_ATTEMPTS} groups with equal rewards: {group.rewards}"

        searched = 0
        for t in trajectories:
            assert t.reward is not None and set(t.metrics) >= REWARD_METRICS
            assert t.metrics["turns"] == MAX_TURNS
            record = await t.get_record()
            assert len(record.completions) == MAX_TURNS
            assert all(c.step == 0 and c.output_token_ids for c in record.completions)
            first, second = record.completions[:2]
            assert first.request["tools"] == TOOL_SPECS
            # The second request carries the first turn and what the agent answered to it: the search results
            # (or the tool's error) for the forced call, or the feedback when no call came back.
            *_, reply, answer = second.request["messages"]
            assert reply["role"] == "assistant"
            if reply.get("tool_calls"):
                searched += 1
                assert [c["function"]["name"] for c in reply["tool_calls"]] == ["search_inbox"]
                assert answer["role"] == "tool" and answer["content"].startswith(SEARCH_REPLIES)
            else:
                # The forced first call did not parse (the free second turn may write more calls of any kind).
                assert t.metrics["unparsed_tool_calls"] >= 1
                assert answer["role"] == "user" and answer["content"].startswith("Error: your tool call could not")
        assert searched >= 1, "no trajectory of the group made the forced search_inbox call"

        result = await model.train([group], learning_rate=1e-5)
        assert result.trained, result.done.reason
        assert result.step == 1

        # One short turn is enough to show the new step serves the agent (its call may be cut off: the agent
        # then answers with its feedback; what counts is the step that served it).
        after = await rollout(model, question, data.db_path, max_turns=1, temperature=1.0, max_tokens=AFTER_TOKENS,
                              first_turn_tool_choice=FORCE_SEARCH)
        assert not after.failed, after.exception
        assert {c.step for c in (await after.get_record()).completions} == {1}
