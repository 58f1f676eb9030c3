"""Vocab-parallel KD loss: the lm_head split by vocabulary rows across a process group (tensor parallel).

    # every process of `group` holds lm_head rows [start, start + size) and the same hidden states
    loss = vocab_parallel_linear_kd(hidden, weight_shard, teacher_ids, teacher_logprobs,
                                    vocab_start=start, vocab_size=V, group=tp_group)

The same loss, options and fused driver as fused_linear_kd (topkd.loss.fused): each process forms
only its [C, V/P] block of a chunk's logits; the row max, the logits at the teacher ids and labels,
and the softmax sums are combined with all_reduce (topkd.loss.chunk.VocabShard), so every process
computes the same buckets and returns the same loss. dL/dhidden is summed over the group inside the
loss (every process gets the full gradient of its replicated input); dL/dweight_shard is this
process's rows only. Per chunk: 4 small all_reduces ([C] or [C, K]); logits never cross processes.
Per call, one all_gather of 5 ints checks that the shards tile the vocabulary and the processes agree.
Tested against the single-process loss with 2 gloo processes (tests/loss/test_vocab_parallel.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from topkd.loss import validate
from topkd.loss.api import prepare, run_fused
from topkd.loss.chunk import VocabShard


def vocab_parallel_linear_kd(
    hidden: Tensor,
    weight_shard: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    mask: Tensor | None = None,
    teacher_logz: Tensor | None = None,
    divergence: str = "kl",
    tail: str = "bucket",
    temperature: float = 1.0,
    beta: float = 0.5,
    labels: Tensor | None = None,
    ce_weight: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    bias_shard: Tensor | None = None,
) -> Tensor:
    """fused_linear_kd for a vocab-sharded lm_head; teacher ids and labels are global vocabulary ids."""
    validate.check_names(divergence, tail, "fused", reduction)
    if not dist.is_initialized():
        raise ValueError("vocab_parallel_linear_kd: expected an initialised torch.distributed process group, got "
                         "none; call torch.distributed.init_process_group (torchrun) first, or use fused_linear_kd")
    x, row_index, rows, spec, chunk = prepare(
        hidden, weight_shard, bias_shard, teacher_ids, teacher_logprobs, mask, teacher_logz, labels,
        dict(divergence=divergence, tail=tail, temperature=temperature, beta=beta, ce_weight=ce_weight),
        chunk_size, vocab_size)
    shard = VocabShard(int(vocab_start), weight_shard.shape[0], int(vocab_size), group)
    check_group(shard, len(rows), chunk)
    return run_fused(x, weight_shard, bias_shard, row_index, rows, spec, reduction, chunk, hidden.shape[:-1], shard)


def check_group(shard: VocabShard, counted: int, chunk: int) -> None:
    """One all_gather of 5 ints: refuse shards that leave gaps, overlap or disagree on the vocabulary, and
    processes that disagree on the counted tokens or chunk size (their collectives would not line up)."""
    on = "cuda" if dist.get_backend(shard.group) == "nccl" else "cpu"  # NCCL moves GPU tensors only
    mine = torch.tensor([shard.start, shard.size, shard.vocab, counted, chunk], dtype=torch.int64, device=on)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(every, mine, group=shard.group)
    spans = sorted((int(e[0]), int(e[1])) for e in every)
    vocabs = {int(e[2]) for e in every}
    edges = [0] + [s + n for s, n in spans]
    if len(vocabs) != 1 or any(s != e for (s, _), e in zip(spans, edges)) or edges[-1] != shard.vocab:
        raise ValueError(f"vocab shards: expected (start, rows) spans tiling [0, {shard.vocab}) once across the "
                         f"group, got {spans} with vocab sizes {sorted(vocabs)}; give process r rows "
                         "[r * V / P, (r + 1) * V / P) of lm_head.weight and the same vocab_size everywhere")
    work = sorted({(int(e[3]), int(e[4])) for e in every})
    if len(work) != 1:
        raise ValueError(f"vocab-parallel loss: expected the same (counted tokens, chunk size) on every process, "
                         f"got {work}; pass the same hidden, mask and chunk_size to every process")
