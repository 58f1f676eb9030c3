"""FSDP2 for the student: each decoder block and the root sharded over the torchrun processes.

    shard_student(module)       # no-op with one process; fully_shard per block, then the root
    state = full_state_dict(module.model)   # gathered on every rank, on CPU, for save_pretrained

The root is the KDStudent module, whose forward runs the fused loss: FSDP2 gathers the
embeddings, final norm and lm_head when that forward starts, so the loss sees the whole head.
Gradients are summed over ranks, not averaged: each rank's loss is already divided by the token
count of the whole global batch, so the sum is the exact gradient of the global mean.
"""

from __future__ import annotations

import torch
from torch import nn

from topkd.base import dist


def shard_student(module: nn.Module, bf16: bool = False) -> nn.Module:
    """bf16: FSDP2 mixed precision, parameters gathered in bf16 for compute, gradients reduced in fp32 into the
    fp32 shards the optimizer keeps."""
    if not dist.active():
        return module
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in module.model.get_decoder().layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return module


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters and buffers on CPU (a collective: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def scalar(t: torch.Tensor) -> float:
    """A reduced value as a float, whether a DTensor (sharded params) or a plain tensor."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)
