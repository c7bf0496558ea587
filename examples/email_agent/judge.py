"""An optional LLM judge for answers the normalising rules call wrong, through any OpenAI-compatible API.

    judge = LLMJudge(openai.AsyncOpenAI(base_url=..., api_key=...), model="gpt-4o-mini")
    breakdown = await grade_with_async_judge(question, answer, sources, stats, judge)
"""

from __future__ import annotations

import openai

from examples.email_agent.records import Question

_INSTRUCTION = (
    "You grade answers to questions about emails. Reply with one word: yes if the candidate answer states "
    "the same fact as the reference answer (formatting and extra words do not matter), otherwise no."
)


class LLMJudge:
    """An `AsyncJudge`: `await judge(question, answer) -> bool`."""

    def __init__(self, client: openai.AsyncOpenAI, model: str) -> None:
        self.client = client
        self.model = model

    async def __call__(self, question: Question, answer: str) -> bool:
        response = await self.client.chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": _INSTRUCTION},
                {"role": "user", "content": f"Question: {question.question}\nReference answer: {question.answer}\n"
                                            f"Candidate answer: {answer}\nSame fact?"},
            ],
            temperature=0.0,
            max_tokens=3,
        )
        verdict = (response.choices[0].message.content or "").strip().lower()
        return verdict.startswith("yes")
