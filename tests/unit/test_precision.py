"""fp32 master weights for bf16 adapters: updates that bf16 would round away are kept, gradients add in fp32."""

from __future__ import annotations

import torch
from artlike_server.torch_worker.precision import MasterWeights
from torch import nn


def bf16_param(value: float, size: int = 4) -> nn.Parameter:
    return nn.Parameter(torch.full((size,), value, dtype=torch.bfloat16))


def test_small_updates_survive_in_the_master_copy_and_reach_the_model() -> None:
    # 0.01 in bf16 has an ulp of 2^-14 ≈ 6.1e-5: a 1e-5 SGD step on the bf16 weight itself is rounded away.
    plain = bf16_param(0.01)
    plain_optimizer = torch.optim.SGD([plain], lr=1e-5)
    model_param = bf16_param(0.01)
    master = MasterWeights([model_param])
    optimizer = torch.optim.SGD(master.parameters, lr=1e-5)
    for _ in range(20):
        plain.grad = torch.ones_like(plain)
        plain_optimizer.step()
        model_param.grad = torch.ones_like(model_param)
        master.accumulate_grads()
        optimizer.step()
        optimizer.zero_grad()
        master.copy_to_model()
    start = torch.tensor(0.01, dtype=torch.bfloat16).float()
    assert torch.equal(plain.float(), torch.full((4,), float(start)))  # the plain bf16 weight never moved
    assert torch.allclose(master.parameters[0], start - 20 * 1e-5)  # 2e-4 down, in fp32
    assert torch.equal(model_param, master.parameters[0].to(torch.bfloat16))  # the model sees it, rounded
    assert model_param.dtype == torch.bfloat16 and master.parameters[0].dtype == torch.float32


def test_gradients_of_several_micro_batches_add_up_in_fp32() -> None:
    model_param = bf16_param(1.0, size=1)
    master = MasterWeights([model_param])
    # 256 + 1 + 1 + ... : in bf16 (8 bits of mantissa) adding 1 to 256 is lost; in fp32 it is not.
    for grad in [256.0] + [1.0] * 8:
        model_param.grad = torch.tensor([grad], dtype=torch.bfloat16)
        master.accumulate_grads()
        assert model_param.grad is None  # moved, so the next backward starts from zero
    assert master.parameters[0].grad is not None
    assert master.parameters[0].grad.item() == 264.0


def test_only_low_precision_parameters_need_masters() -> None:
    assert MasterWeights.needed([bf16_param(1.0)])
    assert not MasterWeights.needed([nn.Parameter(torch.zeros(2))])
