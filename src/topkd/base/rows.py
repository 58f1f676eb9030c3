"""What a valid teacher row is: ids in [0, V), K distinct, finite log-probs <= 0, top-K mass <= 1, a c_T whose
tempered mass is <= 1, labels in range. An entry whose log-prob is -inf is padding (rows of variable K: a
sampled or adaptive cache): it carries no mass, its id may be anything, and each row needs one real entry.
One home for these checks: the loss runs them on the counted tokens of
every batch (topkd/loss/validate.py), `topkd cache import` on every row it reads (topkd/cache/reading/interchange.py).

    check_values(ids, logprobs, logz, labels, vocab, tail="bucket", temperature=1.0)   # ValueError naming the fix

O(N K), never O(N V); rows are walked in blocks, so no N x K float64 temporary is made.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOGPROB_SLACK = 1e-4  # log-probs above this are not log-probs (rounding gives ~1e-7)
MASS_SLACK = 1e-2  # teacher top-K mass above 1 + this means unnormalised input
VALUE_CHECK_ROWS = 4096  # value checks walk rows in blocks so they add no O(N K) float64 peak


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_values(
    ids: Tensor, logprobs: Tensor, logz, labels, vocab: int, tail: str, temperature: float
) -> None:
    """Value checks on the counted tokens ([n, K] etc.). Meta tensors (cost-model traces) have no values."""
    if ids.numel() == 0 or ids.device.type == "meta":
        return
    padding = _check_ids(ids, logprobs, vocab)
    tempered_logz = logz if (logz is not None and tail == "bucket") else None
    dup_rows, mass, tempered = _scan_rows(ids, logprobs, padding, tempered_logz, temperature)
    if dup_rows:
        raise ValueError(
            f"teacher_ids: expected K distinct ids per token, got duplicates in {dup_rows} "
            "token(s); drop repeated ids"
        )
    _check_logprobs(logprobs, mass)
    if logz is not None:
        _need(
            bool(torch.isfinite(logz).all()),
            "teacher_logz: expected finite c_T values, got NaN/inf",
        )
    if tempered_logz is not None:
        _need(
            tempered <= 1 + MASS_SLACK,
            f"teacher_logz: tempered top-K mass exp(a/T - c_T) sums to {tempered:.4g} > 1; c_T must "
            f"be log sum_v exp(a_v/T) over the full vocabulary at T={temperature}",
        )
    if labels is not None:
        _check_labels(labels, vocab)


def _check_ids(ids: Tensor, logprobs: Tensor, vocab: int) -> Tensor | None:
    """Every counted token has a real entry and every real id is in the vocabulary; returns where the padding
    entries are (None: there are none)."""
    padding = logprobs == -math.inf
    if not bool(padding.any()):
        padding = None
    else:
        empty = int(padding.all(dim=-1).sum())
        _need(
            not empty,
            f"teacher_logprobs: expected at least one real entry (a finite log-prob) per counted "
            f"token, got {empty} token(s) of padding only (-inf everywhere); mask those tokens out",
        )
    real = ids if padding is None else ids[~padding]
    lo, hi = int(real.min()), int(real.max())
    _need(
        lo >= 0 and hi < vocab,
        f"teacher_ids: expected values in [0, {vocab}), got range [{lo}, {hi}]; "
        "is the cache built for another vocabulary?",
    )
    return padding


def _scan_rows(
    ids, logprobs, padding, tempered_logz, temperature: float
) -> tuple[int, float, float]:
    """Rows with a repeated id, the largest top-K mass and the largest tempered mass, in row blocks (no N x K
    float64 temporaries)."""
    dup_rows, mass, tempered = 0, 0.0, 0.0
    for a in range(0, ids.shape[0], VALUE_CHECK_ROWS):
        block = slice(a, a + VALUE_CHECK_ROWS)
        distinct = ids[block] if padding is None else _distinct_padding(ids[block], padding[block])
        dup_rows += _duplicate_rows(distinct)
        lp = logprobs[block].double()
        mass = max(mass, lp.exp().sum(-1).max().item())
        if tempered_logz is not None:
            shifted = lp / temperature - tempered_logz[block].double().unsqueeze(-1)
            tempered = max(tempered, shifted.exp().sum(-1).max().item())
    return dup_rows, mass, tempered


def _check_logprobs(logprobs: Tensor, mass: float) -> None:
    bad = torch.isnan(logprobs) | (logprobs == math.inf)
    _need(
        not bool(bad.any()),
        f"teacher_logprobs: expected finite values (or -inf for padding), got "
        f"{int(bad.sum())} NaN/+inf; mask those tokens out or repair the cache",
    )
    top = float(logprobs.max())
    _need(
        top <= LOGPROB_SLACK,
        f"teacher_logprobs: expected log-probabilities (<= 0), got max {top:.4g}; "
        "pass log_softmax(teacher_logits) over the full vocabulary, not raw logits",
    )
    _need(
        mass <= 1 + MASS_SLACK,
        f"teacher_logprobs: expected top-K mass <= 1, got {mass:.4g}; normalise over "
        "the full vocabulary at T=1 (log_softmax), not over the top-K",
    )


def _check_labels(labels: Tensor, vocab: int) -> None:
    valid = labels[labels != -100]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
        raise ValueError(
            f"labels: expected -100 (ignored) or values in [0, {vocab}), got range "
            f"[{int(valid.min())}, {int(valid.max())}]"
        )


def _distinct_padding(ids: Tensor, padding: Tensor) -> Tensor:
    """Padding ids as distinct negatives: padding may repeat any id without being a duplicate."""
    stand_in = -1 - torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    return torch.where(padding, stand_in.to(ids.dtype), ids)


def _duplicate_rows(ids: Tensor) -> int:
    if ids.shape[-1] < 2:
        return 0
    s = ids.sort(dim=-1).values
    return int((s[:, 1:] == s[:, :-1]).any(dim=-1).sum())
