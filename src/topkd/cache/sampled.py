"""Sampled teacher targets (`topkd cache build --targets sampled --samples N`): unbiased sparse KD.

    rows = head_sampled(hidden, weight, bias, n=50, generator=g)   # per token: the distinct drawn ids, count / N

Per position, N draws with replacement from the teacher's full softmax (T = 1); the row keeps the distinct ids
drawn (about 22 of 50 for SmolLM2-135M on Hamlet) with probability count / N, in rank order (count descending,
then id), and padding (log-prob -inf) up to width N; stored ragged as the counts (cache format 5). The targets
sum to 1 over the full vocabulary and their expectation is the teacher's distribution, so KL to them is an
unbiased estimate of the full-vocabulary KD gradient (Anshumann et al., "Sparse Logit Sampling", ACL 2025),
where top-K targets are biased towards the head. The draws come from one seeded generator per shard
(sampling_seed), consumed in the shard's own order, so a rerun or a resumed build writes the same bytes.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from topkd.models import logit_chunks

HEAD_CHUNK_BYTES = 64 * 2**20


def sampling_seed(build_hash: str, shard: int) -> int:
    """The seed of shard j's generator: fixed by the build (its hash) and the shard, nothing else."""
    return int.from_bytes(hashlib.sha256(f"{build_hash}:{shard}".encode()).digest()[:8], "little") >> 1


def distinct_counts(draws: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """[C, N] drawn ids -> (ids [C, N], log-probs [C, N] float32): the distinct ids with log(count / N) in rank
    order (count descending, then id ascending), padding (-inf, id of the row's first) after them."""
    ranked_ids = draws.sort(dim=1).values
    new = torch.ones_like(ranked_ids, dtype=torch.bool)
    new[:, 1:] = ranked_ids[:, 1:] != ranked_ids[:, :-1]
    group = new.long().cumsum(dim=1) - 1  # which distinct id each draw is, ascending
    counts = torch.zeros_like(ranked_ids).scatter_add_(1, group, torch.ones_like(ranked_ids))
    ids = torch.zeros_like(ranked_ids).scatter_(1, group, ranked_ids)  # repeats write the same id
    order = torch.sort(-counts, dim=1, stable=True).indices  # ties keep ascending id order
    counts, ids = counts.gather(1, order), ids.gather(1, order)
    logprobs = torch.where(counts > 0, (counts.double() / n).log(), torch.tensor(-np.inf, dtype=torch.float64))
    ids = torch.where(counts > 0, ids, ids[:, :1])
    return ids, logprobs.float()


@torch.inference_mode()
def head_sampled(hidden: Tensor, weight: Tensor, bias: Tensor | None, n: int, generator: torch.Generator,
                 softcap: float | None = None, chunk_bytes: int = HEAD_CHUNK_BYTES) -> dict[str, np.ndarray]:
    """N draws per row of softmax(hidden @ weight.T + bias) over the full vocabulary (fp32, row chunks: [N, V]
    never exists); rows as the cache build takes them (teacher.head_topk's keys), log_mass 0 and no tail."""
    parts = []
    for _, z in logit_chunks(hidden, weight, bias, softcap, chunk_bytes):
        probs = torch.softmax(z, dim=1)
        draws = torch.multinomial(probs, n, replacement=True, generator=generator)
        ids, logprobs = distinct_counts(draws, n)
        parts.append((ids.to(torch.int32).cpu().numpy(), logprobs.cpu().numpy()))
    ids = np.concatenate([p[0] for p in parts])
    logprobs = np.concatenate([p[1] for p in parts])
    rows = len(ids)
    return {"ids": ids, "logprobs": logprobs, "log_mass": np.zeros(rows, np.float32),
            "log_tail": np.full(rows, -np.inf, np.float32), "logz": np.zeros((rows, 0), np.float32),
            "log_mass_t": np.zeros((rows, 0), np.float32)}
