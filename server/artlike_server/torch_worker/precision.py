"""fp32 master weights for trainable parameters kept in a lower precision (bf16 LoRA on a bf16 base model).

With the adapter in the base model's dtype, the forward and backward passes run without casts: PEFT's
default upcasts LoRA weights to fp32 and then casts every activation that enters an adapter to fp32 and
back, which costs a large share of a bf16 step on CPU (bench/train_throughput.py measures the step).
The optimizer must not step bf16 weights, though: a 1e-5 update of a 0.01 weight is below half a bf16
ulp and rounds away. So the optimizer owns fp32 copies: gradients are added to them after each
micro-batch (accumulation in fp32), the optimizer and clipping work on them, and the model's parameters
are refreshed from them after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MasterWeights:
    def __init__(self, model_parameters: Sequence[nn.Parameter]) -> None:
        self.model_parameters = list(model_parameters)
        self.parameters = [nn.Parameter(p.detach().float().clone()) for p in self.model_parameters]

    @staticmethod
    def needed(model_parameters: Sequence[nn.Parameter]) -> bool:
        return any(p.dtype != torch.float32 for p in model_parameters)

    def accumulate_grads(self) -> None:
        """Move the model parameters' gradients into the fp32 copies (added to what is there)."""
        for model_param, master in zip(self.model_parameters, self.parameters, strict=True):
            if model_param.grad is None:
                continue
            if master.grad is None:
                master.grad = model_param.grad.float()
            else:
                master.grad.add_(model_param.grad)
            model_param.grad = None

    def zero_grads(self) -> None:
        for param in (*self.model_parameters, *self.parameters):
            param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for model_param, master in zip(self.model_parameters, self.parameters, strict=True):
            model_param.copy_(master)
