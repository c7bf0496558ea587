"""Which engine serves the next request: least outstanding requests, with trajectory affinity.

Pure bookkeeping (no I/O), so the policy is tested on its own:

- A request with an affinity key (the trajectory id of a trajectory URL) goes to the engine that served
  that key last, while that engine is a candidate: an agent's turns share a growing prefix, and only
  that engine holds it in its prefix cache.
- Otherwise (a new key, no key, or its engine left the rotation) it goes to the candidate with the
  fewest requests in flight; ties go to the one that has served fewest requests so far, then the first
  listed, so an idle pool still spreads its load.
- The table of keys is an LRU bounded by `max_keys`: an old trajectory that is forgotten only loses its
  cache locality, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    """An engine's place in the pool's rotation."""

    OUT = "out"  # not (yet) holding the pool's adapters (or weights): takes no traffic
    JOINING = "joining"  # receiving the pool's adapters
    SERVING = "serving"


@dataclass
class Load:
    """What the policy reads of one engine."""

    id: str
    outstanding: int = 0  # requests sent and not yet fully answered
    served: int = 0  # requests sent since the start


def least_loaded(candidates: Sequence[Load]) -> Load | None:
    """The candidate with the fewest requests in flight (then the fewest served, then the first)."""
    best: Load | None = None
    for load in candidates:
        if best is None or (load.outstanding, load.served) < (best.outstanding, best.served):
            best = load
    return best


# A policy engine decodes its step faster than a LoRA engine on the same cores (bench/lora_serving.py
# measures by how much); once it has this many times the requests of the least busy LoRA engine (and a
# batch's worth), the LoRA engines take the overflow instead of idling.
POLICY_SPEEDUP = 2
POLICY_SPILL_MIN = 16


def spill_to_lora(policy: Load, lora: Load | None) -> bool:
    """Whether a request for the policy's step goes to the LoRA engine `lora` rather than the policy engine.
    E.g. policy 40 outstanding, LoRA 10 → False (40 < 2·11); policy 40, LoRA 0 → True; policy 8, LoRA 0 →
    False (below a batch's worth, the faster engine batches it almost for free)."""
    return lora is not None and policy.outstanding >= max(POLICY_SPILL_MIN, POLICY_SPEEDUP * (lora.outstanding + 1))


class AffinityTable:
    """Affinity key → the id of the engine that served it last (LRU, at most `max_keys` entries)."""

    def __init__(self, max_keys: int = 100_000) -> None:
        self.max_keys = max(1, max_keys)
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, key: str) -> str | None:
        return self._owners.get(key)

    def assign(self, key: str, engine_id: str) -> None:
        self._owners[key] = engine_id
        self._owners.move_to_end(key)
        while len(self._owners) > self.max_keys:
            self._owners.popitem(last=False)

    def forget_engine(self, engine_id: str) -> None:
        """Drop every key owned by `engine_id` (it restarted: its prefix cache is gone)."""
        for key in [k for k, owner in self._owners.items() if owner == engine_id]:
            del self._owners[key]


def choose(candidates: Sequence[Load], affinity: AffinityTable, key: str | None) -> Load | None:
    """The engine for the next request (None: no candidate); records the choice for `key`."""
    if not candidates:
        return None
    chosen: Load | None = None
    if key is not None and (owner := affinity.owner(key)) is not None:
        chosen = next((load for load in candidates if load.id == owner), None)
    if chosen is None:
        chosen = least_loaded(candidates)
    assert chosen is not None
    if key is not None:
        affinity.assign(key, chosen.id)
    return chosen
