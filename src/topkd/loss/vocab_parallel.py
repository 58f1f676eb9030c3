"""Vocab-parallel KD: the lm_head split by vocabulary rows across a process group (tensor parallel).

    # every process of `group` holds lm_head rows [start, start + size) and the same hidden states
    loss = topkd.fused_linear_kd(hidden, weight_shard, teacher_ids, teacher_logprobs,
                                 vocab_parallel=VocabParallel(start=start, vocab_size=V, group=tp_group))

An option of fused_linear_kd (same loss, options and fused driver, topkd.loss.fused): each process forms
only its [C, V/P] block of a chunk's logits; the row max, the logits at the teacher ids and labels,
and the softmax sums are combined with all_reduce (topkd.loss.chunk.VocabShard), so every process
computes the same buckets and returns the same loss. dL/dhidden is summed over the group inside the
loss (every process gets the full gradient of its replicated input); dL/dweight_shard is this
process's rows only. Per chunk: 4 small all_reduces ([C] or [C, K]); logits never cross processes.
Per call, one all_gather of 5 ints checks that the shards tile the vocabulary and the processes agree.
Teacher ids and labels are global vocabulary ids. Tested against the single-process loss with 2 gloo
processes (tests/loss/test_vocab_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from topkd.base.dist import collective_device
from topkd.loss.chunk import VocabShard


@dataclass(frozen=True)
class VocabParallel:
    """This process holds lm_head rows [start, start + weight.shape[0]) of a vocab_size vocabulary, split across
    `group` (None: the default group)."""

    start: int
    vocab_size: int
    group: object = None


def shard_for(vp: VocabParallel, weight_shard: Tensor, counted: int, chunk: int) -> VocabShard:
    """The chunk math's view of this process's shard, after checking the group agrees on it."""
    if not dist.is_initialized():
        raise ValueError(
            "vocab_parallel: expected an initialised torch.distributed process group, got none; call "
            "torch.distributed.init_process_group (torchrun) first, or leave vocab_parallel=None"
        )
    shard = VocabShard(int(vp.start), weight_shard.shape[0], int(vp.vocab_size), vp.group)
    check_group(shard, counted, chunk)
    return shard


def check_group(shard: VocabShard, counted: int, chunk: int) -> None:
    """One all_gather of 5 ints: refuse shards that leave gaps, overlap or disagree on the vocabulary, and
    processes that disagree on the counted tokens or chunk size (their collectives would not line up)."""
    mine = torch.tensor(
        [shard.start, shard.size, shard.vocab, counted, chunk],
        dtype=torch.int64,
        device=collective_device(shard.group),
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(every, mine, group=shard.group)
    spans = sorted((int(e[0]), int(e[1])) for e in every)
    vocabs = {int(e[2]) for e in every}
    edges = [0] + [s + n for s, n in spans]
    if (
        len(vocabs) != 1
        or any(s != e for (s, _), e in zip(spans, edges))
        or edges[-1] != shard.vocab
    ):
        raise ValueError(
            f"vocab shards: expected (start, rows) spans tiling [0, {shard.vocab}) once across the "
            f"group, got {spans} with vocab sizes {sorted(vocabs)}; give process r rows "
            "[r * V / P, (r + 1) * V / P) of lm_head.weight and the same vocab_size everywhere"
        )
    work = sorted({(int(e[3]), int(e[4])) for e in every})
    if len(work) != 1:
        raise ValueError(
            f"vocab-parallel loss: expected the same (counted tokens, chunk size) on every process, "
            f"got {work}; pass the same hidden, mask and chunk_size to every process"
        )
