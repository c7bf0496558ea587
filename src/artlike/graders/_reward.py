"""SeekrFlow's RewardComponents: graders combined by weight, plus the format reward.

Weight rules (SeekrFlow's reinforcement tuning docs):
  * no grader weights: the graders share equally; some but not all weighted: an error;
  * `format_reward_weight` defaults to 0.1, and then the grader weights must sum to 1.0 and cover the
    other 0.9 of the reward: reward = 0.1 * format + 0.9 * sum(w_i * s_i);
  * `format_reward_weight` set explicitly: format + grader weights must sum to 1.0 (unweighted graders
    share 1 - format equally): reward = f * format + sum(w_i * s_i).

    >>> RewardComponents.model_validate({"graders": [{"type": "math_accuracy"}]}).resolved_weights()
    (0.1, [0.9])
    >>> RewardComponents.model_validate({"format_reward_weight": 0.2, "graders": [
    ...     {"type": "math_accuracy", "weight": 0.3},
    ...     {"type": "text_similarity", "operation": "bleu", "weight": 0.5}]}).resolved_weights()
    (0.2, [0.3, 0.5])
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ._types import Grader

DEFAULT_FORMAT_REWARD_WEIGHT = 0.1
_TOLERANCE = 1e-6


def _weights_error(message: str, weights: list[float | None], format_weight: float | None) -> PydanticCustomError:
    # A custom error type, so callers can tell weight rules from other validation errors.
    return PydanticCustomError(
        "grader_weights",
        "{message}: grader weights {weights}, format_reward_weight {format_reward_weight}",
        {"message": message, "weights": weights, "format_reward_weight": format_weight},
    )


class RewardComponents(BaseModel):
    model_config = ConfigDict(extra="forbid")

    graders: list[Grader] = Field(min_length=1)
    format_reward_weight: float = Field(DEFAULT_FORMAT_REWARD_WEIGHT, ge=0.0, le=1.0)
    extract_answer: bool = Field(
        True, description="Graders see the `<answer>` content as sample.output_text, where there is one.")

    @property
    def format_weight_is_explicit(self) -> bool:
        return "format_reward_weight" in self.model_fields_set

    @model_validator(mode="after")
    def _check_weights(self) -> RewardComponents:
        weights = [g.weight for g in self.graders]
        explicit = self.format_reward_weight if self.format_weight_is_explicit else None
        given = [w for w in weights if w is not None]
        if given and len(given) != len(weights):
            raise _weights_error("give every grader a weight or none", weights, explicit)
        if given:
            total = math.fsum(given) + (explicit or 0.0)
            what = "format_reward_weight + grader weights" if explicit is not None else "grader weights"
            if abs(total - 1.0) > _TOLERANCE:
                raise _weights_error(f"{what} must sum to 1.0, not {total:g}", weights, explicit)
        return self

    def resolved_weights(self) -> tuple[float, list[float]]:
        """(format weight, one weight per grader), summing to 1.0."""
        f = self.format_reward_weight
        n = len(self.graders)
        weights = [g.weight for g in self.graders]
        if self.format_weight_is_explicit:
            return f, [w if w is not None else (1.0 - f) / n for w in weights]
        return f, [(1.0 - f) * (w if w is not None else 1.0 / n) for w in weights]
