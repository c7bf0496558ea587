"""Step 0 of a new model, written by the trainer, with its failures turned into API errors: a LoRA config
PEFT refuses is the caller's to fix (400), a trainer that crashed or timed out is a 503 to retry."""

from __future__ import annotations

from pathlib import Path

from artlike.types import LoraConfig, RewardHeadConfig

from ..errors import InvalidRequest, ServiceUnavailable
from .trainer_client import TrainerCrashed, TrainerError, TrainerProcess, TrainerTimeout

CONFIG_ERROR_KINDS = frozenset({"ValueError", "TypeError", "KeyError", "AdapterError"})
"""Worker-side exception types that mean PEFT refused the LoRA config (not a trainer bug)."""


class TrainerAdapterInitializer:
    """`models.registry.AdapterInitializer` over the trainer process."""

    def __init__(self, trainer: TrainerProcess) -> None:
        self._trainer = trainer

    async def __call__(self, name: str, lora: LoraConfig, staging: Path, *,
                       reward_head: RewardHeadConfig | None) -> None:
        try:
            await self._trainer.init_adapter(name, lora, staging, reward_head=reward_head)
        except TrainerError as error:
            if error.kind in CONFIG_ERROR_KINDS:
                raise InvalidRequest(f"the trainer cannot build this LoRA: {error.message}", param="lora",
                                     code="invalid_lora_config") from error
            raise
        except (TrainerCrashed, TrainerTimeout) as error:
            raise ServiceUnavailable(f"the trainer is not available: {error}", retry_after=30.0,
                                     code="trainer_unavailable") from error
