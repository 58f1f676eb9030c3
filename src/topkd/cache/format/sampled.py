"""Sampled teacher targets (`topkd cache build --targets sampled --samples N`): unbiased sparse KD.

    rows = head_sampled(hidden, weight, bias, n=50, generator=g)   # per token: the distinct drawn ids, count / N
    rows = head_sampled(hidden, weight, bias, n=50, generator=g, head=8)  # the 8 most likely exact, 50 draws after

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
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from topkd.cache.format.engine_rows import EngineRows
from topkd.models import logit_chunks

HEAD_CHUNK_BYTES = 64 * 2**20


def sampling_seed(build_hash: str, shard: int) -> int:
    """The seed of shard j's generator: fixed by the build (its hash) and the shard, nothing else."""
    return (
        int.from_bytes(hashlib.sha256(f"{build_hash}:{shard}".encode()).digest()[:8], "little") >> 1
    )


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
    logprobs = torch.where(
        counts > 0, (counts.double() / n).log(), torch.tensor(-np.inf, dtype=torch.float64)
    )
    ids = torch.where(counts > 0, ids, ids[:, :1])
    return ids, logprobs.float()


@dataclass(frozen=True)
class Sampler:
    """--targets sampled: `samples` draws per token from `generator`, after the `head` most likely ids kept exact
    (--head K0; 0: every entry drawn)."""

    generator: torch.Generator
    samples: int
    head: int = 0

    @property
    def width(self) -> int:
        return self.head + self.samples

    def rows(
        self, hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None = None
    ) -> EngineRows:
        return head_sampled(
            hidden, weight, bias, self.samples, self.generator, softcap, head=self.head
        )


@torch.inference_mode()
def head_sampled(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    n: int,
    generator: torch.Generator,
    softcap: float | None = None,
    chunk_bytes: int = HEAD_CHUNK_BYTES,
    head: int = 0,
) -> EngineRows:
    """N draws per row of softmax(hidden @ weight.T + bias) over the full vocabulary (fp32, row chunks: [N, V]
    never exists); rows as the cache build takes them (EngineRows), no tail.

    head K0 > 0 (the hybrid): the K0 most likely ids with their exact probabilities, then N draws from the rest
    of the distribution with probability rest_mass x count / N: the head is exact, the rest unbiased."""
    parts = []
    for _, z in logit_chunks(hidden, weight, bias, softcap, chunk_bytes):
        probs = torch.softmax(z, dim=1)
        parts.append(
            _sampled_rows(probs, n, generator, head)
            if head
            else distinct_counts(
                torch.multinomial(probs, n, replacement=True, generator=generator), n
            )
        )
    ids = torch.cat([p[0] for p in parts]).to(torch.int32).cpu().numpy()
    logprobs = torch.cat([p[1] for p in parts]).cpu().numpy()
    rows = len(ids)
    log_mass = np.logaddexp.reduce(logprobs.astype(np.float64), axis=1) if head else np.zeros(rows)
    return EngineRows(
        ids=ids,
        logprobs=logprobs,
        log_mass=log_mass.astype(np.float32),
        log_tail=np.full(rows, -np.inf, np.float32),
        logz=np.zeros((rows, 0), np.float32),
        log_mass_t=np.zeros((rows, 0), np.float32),
    )


def _sampled_rows(
    probs: Tensor, n: int, generator: torch.Generator, head: int
) -> tuple[Tensor, Tensor]:
    """The hybrid's rows: the exact head, then the draws from the rest (no id twice: the head has weight 0 there),
    ranked by log-prob; a row whose rest has no mass (fp32) keeps its head alone, the draws padding."""
    top = probs.topk(head, dim=1)
    rest = probs.scatter(1, top.indices, 0.0)
    rest_mass = rest.sum(dim=1, dtype=torch.float64)
    rest[rest_mass == 0, 0] = 1.0  # something to draw from; those draws get log-prob -inf below
    ids, logprobs = distinct_counts(
        torch.multinomial(rest, n, replacement=True, generator=generator), n
    )
    logprobs = (logprobs.double() + rest_mass.log()[:, None]).float()
    ids = torch.cat([top.indices, ids], dim=1)
    logprobs = torch.cat([top.values.log(), logprobs], dim=1)
    order = torch.sort(-logprobs, dim=1, stable=True).indices
    ids, logprobs = ids.gather(1, order), logprobs.gather(1, order)
    return torch.where(torch.isneginf(logprobs), ids[:, :1], ids), logprobs
