"""The objective seam: what the training loop optimises, one module per objective.

Each objective module holds a pure loss function on tensors (shapes in comments, the maths in its
docstring, worked examples in tests/unit) and an `Objective` adapter that says what the loop must hand it:
the loop computes the trainer's logprobs of every micro-batch, the reference policy's when
`needs_reference`, and calls `loss()`; it never branches on which objective runs. `build_objective` maps a
job's config (`artlike.types.TrainConfig`, a union on `objective`) to its adapter, and a training session's
Tinker-compatible pass (`trainer_ipc.tinker_loss.TinkerLossConfig`, server-internal) to its own.

    objective   module     config                 loss
    grpo        grpo.py    GRPOConfig             PPO clip on token ratios (Dr. GRPO: constant normaliser)
    cispo       cispo.py   CISPOConfig            clipped, detached importance weight × REINFORCE
    gspo        gspo.py    GSPOConfig             PPO clip on the sequence-level ratio
    importance_sampling    ImportanceSamplingConfig  −ρ·A per token, unclipped (importance_sampling.py)
    sft         sft.py     SFTConfig              cross-entropy on the examples' assistant tokens
    dpo         dpo.py     DPOConfig              preference loss on pairs' log-ratios to the reference
    reward_model  reward_model.py  RewardModelConfig  Bradley–Terry on pairs / masked MSE on the reward head
    ppo         ppo.py     PPOConfig              PPO clip + clipped value loss on GAE advantages (value head)
    tinker      tinker.py  TinkerLossConfig       Tinker's losses, summed, on per-token coefficients (`extras`)

Pair structure comes with the data, not the objective: sequences of a preference pair (`TrainSequence.preference`)
always share an optimizer step and a micro-batch, and `PolicyBatch.pairs` names their rows.

Beyond logprobs an objective may ask for `heads` ("value": the policy's value head at every position,
"reward": the reward model's pooled scores), for the entropy with its gradient (`entropy_gradient`), and for
a `prepare` pass once per job (no gradient) that turns the batch into per-sequence tensors (`extras`: PPO's
advantages and returns) and carries a small state from step to step (PPO's KL coefficient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from artlike.types import (
    CISPOConfig,
    DPOConfig,
    GRPOConfig,
    GSPOConfig,
    ImportanceSamplingConfig,
    PPOConfig,
    RewardHeadConfig,
    RewardModelConfig,
    SFTConfig,
    TrainConfig,
)
from artlike_server.torch_worker.objectives.base import (
    BaseObjective,
    JobPasses,
    LossOutput,
    Objective,
    PolicyBatch,
    Preparation,
    trainable_counts,
)
from artlike_server.torch_worker.objectives.cispo import CISPO
from artlike_server.torch_worker.objectives.dpo import DPO
from artlike_server.torch_worker.objectives.grpo import GRPO
from artlike_server.torch_worker.objectives.gspo import GSPO
from artlike_server.torch_worker.objectives.importance_sampling import ImportanceSampling
from artlike_server.torch_worker.objectives.ppo import PPO
from artlike_server.torch_worker.objectives.reward_model import RewardModel
from artlike_server.torch_worker.objectives.sft import SFT
from artlike_server.torch_worker.objectives.tinker import Tinker
from artlike_server.trainer_ipc.tinker_loss import TinkerLossConfig

__all__ = ["BaseObjective", "JobPasses", "LossOutput", "Objective", "PolicyBatch", "Preparation", "build_objective",
           "trainable_counts"]


def _builders() -> dict[type, Callable[[Any], Objective]]:
    return {GRPOConfig: GRPO, CISPOConfig: CISPO, GSPOConfig: GSPO, ImportanceSamplingConfig: ImportanceSampling,
            SFTConfig: SFT, DPOConfig: DPO, RewardModelConfig: RewardModel, PPOConfig: PPO, TinkerLossConfig: Tinker}


def build_objective(config: TrainConfig | TinkerLossConfig, *,
                    reward_head: RewardHeadConfig | None = None) -> Objective:
    """The objective a config asks for (`reward_head`: the trained reward model's, for its objective)."""
    if isinstance(config, RewardModelConfig):

        return RewardModel(config, reward_head)
    return _builders()[type(config)](config)
