"""Small heads on the decoder's hidden states: a policy's value head (PPO) and a reward model's score head.

Both run in float32 on the hidden states (cast up from the base dtype) and are trained by their own
optimizer group next to the LoRA weights. They are saved with the step they belong to:

- the reward head is the `score` layer of Hugging Face's `*ForSequenceClassification` (a linear layer
  without bias, K outputs), stored in `adapter_model.safetensors` as `base_model.model.score.weight`, with
  `"task_type": "SEQ_CLS"` and `"modules_to_save": ["score"]` in `adapter_config.json`; so PEFT loads the
  step onto `AutoModelForSequenceClassification.from_pretrained(base, num_labels=K)`. Pooling and
  objective weights are in `reward_head.json`.
- the value head (a linear layer with bias, one output) is `value_head.safetensors` beside the adapter;
  vLLM and PEFT ignore it.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from artlike.types import RewardHeadConfig
from artlike_server.torch_worker.objectives.reward_model import combined

SCORE_KEY = "base_model.model.score.weight"  # where PEFT keeps a SEQ_CLS model's `modules_to_save` head
REWARD_HEAD_FILE = "reward_head.json"
VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(nn.Module):
    """V(hidden) = w·h + b; zero at first (every state's value starts at 0)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] float32"""
        values: torch.Tensor = self.linear(hidden.float()).squeeze(-1)
        return values

    def save(self, directory: Path) -> None:
        save_file({"weight": self.linear.weight.detach().contiguous(), "bias": self.linear.bias.detach().contiguous()},
                  str(directory / VALUE_HEAD_FILE))  # fmt: skip

    @classmethod
    def load(cls, directory: Path, hidden_size: int, device: torch.device) -> ValueHead | None:
        path = directory / VALUE_HEAD_FILE
        if not path.is_file():
            return None
        head = cls(hidden_size)
        head.linear.load_state_dict(load_file(str(path)))
        return head.to(device)


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling: str) -> torch.Tensor:
    """Each row's hidden state at its last token ("last") or averaged over its tokens ("mean"); rows are
    right-padded to T. [B, T, H], [B] -> [B, H]

    >>> pool(torch.arange(6.0).view(1, 3, 2), torch.tensor([2]), "last")
    tensor([[2., 3.]])
    >>> pool(torch.arange(6.0).view(1, 3, 2), torch.tensor([2]), "mean")
    tensor([[1., 2.]])
    """
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if pooling == "last":
        return hidden[rows, lengths - 1]
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    mask = (positions[None, :] < lengths[:, None]).to(hidden.dtype)  # [B, T]
    return (hidden * mask[..., None]).sum(dim=1) / lengths.clamp(min=1)[:, None].to(hidden.dtype)


class RewardHead(nn.Module):
    """K scores per sequence from its pooled hidden state: s = W·pool(h), W [K, H] (HF's `score`)."""

    def __init__(self, hidden_size: int, config: RewardHeadConfig, *, seed: int = 0, std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.score = nn.Linear(hidden_size, config.num_objectives, bias=False, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(self.score.weight.shape, generator=generator) * std)

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, T, H], [B] -> [B, K] float32"""
        scores: torch.Tensor = self.score(pool(hidden, lengths, self.config.pooling).float())
        return scores

    def combined(self, scores: torch.Tensor) -> torch.Tensor:
        """Σₖ wₖ·sₖ. [B, K] -> [B]"""
        return combined(scores, self.config.weights)

    def state(self) -> dict[str, torch.Tensor]:
        """The head's entry of a PEFT SEQ_CLS adapter's weights."""
        return {SCORE_KEY: self.score.weight.detach().contiguous()}

    def save_config(self, directory: Path) -> None:
        (directory / REWARD_HEAD_FILE).write_bytes(orjson.dumps(self.config.model_dump(), option=orjson.OPT_INDENT_2))

    @classmethod
    def load(cls, directory: Path, weights: dict[str, torch.Tensor], hidden_size: int,
             device: torch.device) -> RewardHead | None:
        """The head of a reward model's step (None when the directory holds no reward head)."""
        path = directory / REWARD_HEAD_FILE
        if not path.is_file() or SCORE_KEY not in weights:
            return None
        config = RewardHeadConfig.model_validate(orjson.loads(path.read_bytes()))
        head = cls(hidden_size, config)
        if tuple(weights[SCORE_KEY].shape) != tuple(head.score.weight.shape):
            raise ValueError(f"{directory}: the score head is {tuple(weights[SCORE_KEY].shape)}, expected "
                             f"{tuple(head.score.weight.shape)}")
        with torch.no_grad():
            head.score.weight.copy_(weights[SCORE_KEY].float())
        return head.to(device)
