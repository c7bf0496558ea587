"""LangGraph's prebuilt ReAct agent with one tool inside an artlike trajectory. Every model call of the
agent loop (the tool call, then the answer after the tool's result) is recorded in the trajectory, and
training masks the tool result: only what the model sampled is trained.

    pip install artlike langgraph langchain-openai
    python -m examples.integrations.langgraph_example --server http://127.0.0.1:8000

The server must parse tool calls (`artlike serve` picks a parser for the model).
"""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from examples.integrations.common import demo

QUESTION = "What is the weather in Paris?"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"18C and sunny in {city}"


async def run(base_url: str, model: str, api_key: str) -> str:
    llm = ChatOpenAI(base_url=base_url, model=model, api_key=api_key, temperature=1.0, max_tokens=48)
    agent = create_react_agent(llm, [get_weather], prompt="Use the tools, then answer in one sentence.")
    # A small model may call tools forever: bound the loop (each model call and tool run is a step).
    state = await agent.ainvoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 6})
    return str(state["messages"][-1].content)


if __name__ == "__main__":
    demo(run, "langgraph-demo", __doc__)
