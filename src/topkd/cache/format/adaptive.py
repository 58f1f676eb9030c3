"""Adaptive top-K targets (`topkd cache build --targets topp --top-p P --min-k M`): per token, the fewest of the
teacher's top-K entries whose mass reaches P (at least M, at most K); the rest join the tail bucket, exactly.

    rows = adaptive_rows(head_topk_rows, top_p=0.95, min_k=4, temperatures=(2.0,))

A peaked position keeps a handful of ids and a flat one up to K, so bytes follow the teacher's entropy. Kept
entries are unchanged; the dropped ones become padding (log-prob -inf; cache format 5) and their mass is added
to the stored tail (log_tail), so the bucket loss still sees the whole distribution in K + 1 outcomes; the
exact tempered head mass (log_mass_t) is recomputed over the kept entries from the stored c_T.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from topkd.cache.format.engine_rows import EngineRows


def adaptive_rows(
    rows: EngineRows, top_p: float, min_k: int, temperatures: tuple[float, ...] = ()
) -> EngineRows:
    """Rows as head_topk gives them (rank order) -> the same rows with entries past mass top_p as padding."""
    lp = rows.logprobs.astype(np.float64)
    k = lp.shape[1]
    p = np.exp(lp)
    # fewest reaching P
    keep = np.clip(1 + (np.cumsum(p, axis=1) < top_p).sum(axis=1), min(min_k, k), k)
    padding = np.arange(k)[None] >= keep[:, None]
    tail = np.exp(rows.log_tail.astype(np.float64)) + np.where(padding, p, 0.0).sum(axis=1)
    kept = np.where(padding, -np.inf, lp)
    with np.errstate(divide="ignore"):
        log_tail = np.log(tail)
    out = dataclasses.replace(
        rows,
        ids=np.where(padding, rows.ids[:, :1], rows.ids),
        logprobs=kept.astype(np.float32),
        log_mass=np.logaddexp.reduce(kept, axis=1).astype(np.float32),
        log_tail=log_tail.astype(np.float32),
    )
    if not temperatures:
        return out
    logz = rows.logz.astype(np.float64)
    mass_t = [
        np.logaddexp.reduce(kept / t, axis=1) - logz[:, i] for i, t in enumerate(temperatures)
    ]
    return dataclasses.replace(out, log_mass_t=np.stack(mass_t, axis=1).astype(np.float32))
