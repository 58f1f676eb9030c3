"""Float64 brute-force oracle for the KD loss: full logits, explicit bucket distributions.

Written independently of topkd's code (no shared helpers), so agreement means something.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_problem(
    n=37,
    vocab=101,
    hidden=16,
    k=7,
    dtype=torch.float64,
    seed=0,
    batch=None,
    bias=True,
    temperatures=(0.5, 1.0, 2.0),
    teacher_scale=3.0,
):
    """Random student (X, W, b) and a full teacher turned into K distinct ids + log-probs + c_T."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5 * 2
    b = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5 if bias else None
    full = torch.log_softmax(
        torch.randn(n, vocab, generator=g, dtype=torch.float64) * teacher_scale, -1
    )
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    logprobs = full.gather(1, ids)
    logz = {t: torch.logsumexp(full / t, -1) for t in temperatures}
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = -100
    mask = torch.rand(n, generator=g) > 0.3
    out = dict(
        x=x, w=w, b=b, ids=ids, logprobs=logprobs, logz=logz, labels=labels, mask=mask, full=full
    )
    if batch is not None:
        for key in ("x", "ids", "logprobs", "labels", "mask", "full"):
            out[key] = out[key].reshape(batch, n // batch, *out[key].shape[1:])
        out["logz"] = {t: v.reshape(batch, n // batch) for t, v in logz.items()}
    for key in ("x", "w", "b"):
        if out[key] is not None:
            out[key] = out[key].to(dtype)
    return out


def _safe_plogpq(p, log_p, log_q):
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))


def oracle(
    x,
    w,
    b,
    ids,
    logprobs,
    *,
    mask=None,
    teacher_logz=None,
    divergence="kl",
    tail="bucket",
    temperature=1.0,
    beta=0.5,
    labels=None,
    ce_weight=0.0,
    reduction="mean",
    dtype=torch.float64,
    softcap=None,
):
    """The loss with plain autograd in `dtype`: float64 is the oracle; bf16 etc. is "naive same-dtype"."""
    vocab, k, h = w.shape[0], ids.shape[-1], x.shape[-1]
    lead = x.shape[:-1]
    logits = x.to(dtype).reshape(-1, h) @ w.to(dtype).T + (0 if b is None else b.to(dtype))
    if softcap:  # Gemma-2 style final logit soft-capping
        logits = softcap * torch.tanh(logits / softcap)
    t = float(temperature)
    log_q_full = torch.log_softmax(logits / t, -1)
    idsf = ids.reshape(-1, k).long()
    s = log_q_full.gather(1, idsf)
    a = logprobs.reshape(-1, k).to(dtype)
    if tail == "renorm":
        p_top = torch.softmax(a / t, -1)
    elif teacher_logz is not None:
        p_top = torch.exp(a / t - teacher_logz.reshape(-1, 1).to(dtype))
    else:
        assert t == 1.0
        p_top = a.exp()
    q_top = s.exp()
    if k == vocab:  # the tail bucket is empty for both: leave it out
        P, Q = p_top, q_top
    else:
        p_tail = (
            torch.zeros_like(p_top[:, :1])
            if tail == "renorm"
            else (1 - p_top.sum(-1, keepdim=True)).clamp_min(0)
        )
        P = torch.cat([p_top, p_tail], -1)
        Q = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], -1)
    logP, logQ = torch.log(P.clamp_min(torch.finfo(dtype).tiny)), torch.log(Q)
    if divergence == "kl":
        kd = _safe_plogpq(P, logP, logQ).sum(-1)
    elif divergence == "reverse_kl":
        kd = _safe_plogpq(Q, logQ, logP).sum(-1)
    elif divergence == "jsd":
        M = beta * P + (1 - beta) * Q
        kd = beta * _safe_plogpq(P, logP, M.log()).sum(-1) + (1 - beta) * _safe_plogpq(
            Q, logQ, M.log()
        ).sum(-1)
    else:
        kd = 0.5 * (P - Q).abs().sum(-1)
    kd = kd * t * t
    counted = torch.ones(kd.shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1)
    ce = torch.zeros_like(kd)
    valid = torch.zeros_like(counted)
    if ce_weight > 0:
        lab = labels.reshape(-1)
        ce = F.cross_entropy(logits, lab, ignore_index=-100, reduction="none")
        valid = lab != -100
    if reduction == "none":
        return ((kd + ce_weight * ce) * counted).reshape(lead)
    kd_c, ce_c = kd[counted], ce[counted & valid]
    if reduction == "sum":
        return kd_c.sum() + ce_weight * ce_c.sum()
    kd_mean = kd_c.sum() / max(int(counted.sum()), 1)
    return kd_mean + ce_weight * ce_c.sum() / max(int((counted & valid).sum()), 1)
