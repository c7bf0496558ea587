"""LiteLLM's `completion` inside an artlike trajectory: the `openai/` provider prefix and `api_base`
send it to the trajectory URL.

    pip install artlike litellm
    python -m examples.integrations.litellm_example --server http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price table from GitHub at import
import litellm

from examples.integrations.common import demo

QUESTION = "What do bees make?"


def answer(base_url: str, model: str, api_key: str) -> str:
    response = litellm.completion(
        model=f"openai/{model}", api_base=base_url, api_key=api_key, temperature=1.0, max_tokens=32,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": QUESTION}])
    return str(response.choices[0].message.content)


async def run(base_url: str, model: str, api_key: str) -> str:
    return await asyncio.to_thread(answer, base_url, model, api_key)


if __name__ == "__main__":
    demo(run, "litellm-demo", __doc__)
