"""The promotion guard: does a candidate step agree with held-out ratings at least as well as the live one?

For each held-out rated answer the engine scores its exact sampled tokens under both steps (one prefill
each, `prompt_logprobs`); `feedback.preference_shift` turns the per-token logprob gains into one number.
The candidate is promoted when shift >= -margin. With no held-out answers whose ratings differ there is
nothing to judge by: the step is promoted and the verdict says why.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from artlike.studio_types import GuardPolicy, GuardVerdict
from artlike.types import CompletionRecord

from ..engine.client import AdapterEngine
from ..models.manager import ModelManager, served_name
from .feedback import RatedAnswer, preference_shift

MAX_ANSWERS = 64  # scoring costs two prefills per answer: judge on the newest held-out answers


async def judge(engine: AdapterEngine, models: ModelManager, model: str, candidate: int, live: int,
                answers: Sequence[RatedAnswer], records: dict[int, CompletionRecord],
                policy: GuardPolicy) -> GuardVerdict:
    usable = [a for a in answers if a.completion_id in records][-MAX_ANSWERS:]
    rewards = [a.reward for a in usable]
    if preference_shift(rewards, [0.0] * len(rewards)) is None:
        return GuardVerdict(candidate_step=candidate, live_step=live, answers=len(usable), shift=None, promoted=True,
                            reason="no held-out ratings that differ to judge by: promoted")
    deltas = []
    async with models.lease(served_name(model, candidate)), models.lease(served_name(model, live)):
        for answer in usable:
            record = records[answer.completion_id]
            tokens = [*record.prompt_token_ids, *record.output_token_ids]
            start = len(record.prompt_token_ids)
            new = await engine.token_logprobs(served_name(model, candidate), tokens, start)
            old = await engine.token_logprobs(served_name(model, live), tokens, start)
            deltas.append(statistics.fmean(n - o for n, o in zip(new, old, strict=True)) if new else 0.0)
    shift = preference_shift(rewards, deltas)
    assert shift is not None
    promoted = shift >= -policy.margin
    verdict = (f"held-out preference shift {shift:+.4f} nats/token on {len(usable)} answers "
               f"{'>=' if promoted else '<'} -{policy.margin:g}")
    return GuardVerdict(candidate_step=candidate, live_step=live, answers=len(usable), shift=shift,
                        promoted=promoted, reason=("promoted: " if promoted else "not promoted: ") + verdict)
