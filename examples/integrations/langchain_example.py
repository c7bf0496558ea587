"""LangChain's `ChatOpenAI` as the agent inside an artlike trajectory: only `base_url`, `model` and
`api_key` change; the chain itself is untouched.

    pip install artlike langchain-openai
    python -m examples.integrations.langchain_example --server http://127.0.0.1:8000
"""

from __future__ import annotations

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from examples.integrations.common import demo

QUESTION = "Why is the sky blue?"


async def run(base_url: str, model: str, api_key: str) -> str:
    llm = ChatOpenAI(base_url=base_url, model=model, api_key=api_key, temperature=1.0, max_tokens=32)
    answer = await llm.ainvoke([SystemMessage("Answer in one short sentence."), HumanMessage(QUESTION)])
    return str(answer.content)


if __name__ == "__main__":
    demo(run, "langchain-demo", __doc__)
