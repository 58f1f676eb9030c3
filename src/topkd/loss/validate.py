"""Input checks for fused_linear_kd: every refusal says what was expected, what came, and the fix.

Cheap checks (shapes, dtypes, names, numbers) run on everything; value checks (id range,
duplicates, finite and normalised log-probs) run on the counted tokens only, since masked
rows are padding that users may fill with anything. All are O(N K), never O(N V).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from topkd.loss.divergences import DIVERGENCES, TAILS

IMPLS = ("fused", "chunked", "dense", "triton")
REDUCTIONS = ("mean", "sum", "none")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOGPROB_SLACK = 1e-4  # log-probs above this are not log-probs (rounding gives ~1e-7)
MASS_SLACK = 1e-2  # teacher top-K mass above 1 + this means unnormalised input
VALUE_CHECK_ROWS = 4096  # value checks walk rows in blocks so they add no O(N K) float64 peak


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _type(ok: bool, message: str) -> None:
    if not ok:
        raise TypeError(message)


def check_names(divergence: str, tail: str, impl: str, reduction: str) -> None:
    for what, value, allowed in (("divergence", divergence, tuple(DIVERGENCES)), ("tail", tail, TAILS),
                                 ("impl", impl, IMPLS), ("reduction", reduction, REDUCTIONS)):
        _need(value in allowed, f"{what}: expected one of {allowed}, got {value!r}")
    _need(not (divergence == "reverse_kl" and tail == "renorm"),
          "divergence='reverse_kl' needs the teacher tail bucket, got tail='renorm' (the renormalised teacher "
          "has zero mass off its top-K, so KL(Q||P) is infinite); use tail='bucket'")


def check_numbers(temperature: float, beta: float, ce_weight: float, divergence: str,
                  chunk_size: int | None) -> None:
    _need(isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0,
          f"temperature: expected a finite number > 0, got {temperature!r}")
    _need(isinstance(ce_weight, (int, float)) and math.isfinite(ce_weight) and ce_weight >= 0,
          f"ce_weight: expected a finite number >= 0, got {ce_weight!r}")
    if divergence == "jsd":
        _need(isinstance(beta, (int, float)) and 0 < beta < 1,
              f"beta: expected 0 < beta < 1 for divergence='jsd', got {beta!r}; use 'kl' for beta=0 "
              "and 'reverse_kl' for beta=1")
    _need(chunk_size is None or (isinstance(chunk_size, int) and chunk_size >= 1),
          f"chunk_size: expected None (from the byte budget) or an int >= 1, got {chunk_size!r}")


def check_softcap(softcap) -> None:
    _need(softcap is None or (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0),
          f"softcap: expected None or a finite number > 0 (the model's final_logit_softcapping), got {softcap!r}")


def check_shapes(hidden: Tensor, weight: Tensor, bias, ids: Tensor, logprobs: Tensor, mask, logz, labels,
                 vocab: int | None = None) -> None:
    """vocab: the full vocabulary when weight holds only some of its rows (vocab-parallel)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("teacher_ids", ids), ("teacher_logprobs", logprobs)):
        _type(isinstance(t, Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _type(hidden.dtype in FLOATS, f"hidden: expected a floating dtype {FLOATS}, got {hidden.dtype}")
    _need(hidden.dim() in (2, 3), f"hidden: expected [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    _need(weight.dim() == 2 and weight.shape[1] == hidden.shape[-1],
          f"weight: expected [V, {hidden.shape[-1]}] (lm_head.weight, H matching hidden), got {tuple(weight.shape)}")
    _type(weight.dtype == hidden.dtype, f"weight: expected dtype {hidden.dtype} like hidden, got {weight.dtype}; "
          "cast one of them (nothing is upcast silently)")
    lead, rows = tuple(hidden.shape[:-1]), weight.shape[0]
    vocab = vocab or rows
    if bias is not None:
        _type(isinstance(bias, Tensor) and bias.dtype == hidden.dtype,
              f"bias: expected a {hidden.dtype} tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
        _need(tuple(bias.shape) == (rows,), f"bias: expected shape ({rows},) like weight's rows, got "
              f"{tuple(bias.shape)}")
    _type(not ids.dtype.is_floating_point and ids.dtype != torch.bool and not ids.dtype.is_complex,
          f"teacher_ids: expected an integer dtype, got {ids.dtype}")
    _need(ids.dim() == len(lead) + 1 and tuple(ids.shape[:-1]) == lead,
          f"teacher_ids: expected shape {lead + ('K',)} matching hidden, got {tuple(ids.shape)}")
    k = ids.shape[-1]
    _need(1 <= k <= vocab, f"teacher_ids: expected 1 <= K <= V={vocab}, got K={k}")
    _type(logprobs.dtype in FLOATS, f"teacher_logprobs: expected a floating dtype, got {logprobs.dtype}")
    _need(logprobs.shape == ids.shape,
          f"teacher_logprobs: expected shape {tuple(ids.shape)} like teacher_ids, got {tuple(logprobs.shape)}")
    _need(not logprobs.requires_grad, "teacher_logprobs: the teacher is a constant; got a tensor that requires "
          "grad; pass teacher_logprobs.detach()")
    _check_per_token("mask", mask, lead, lambda d: d == torch.bool, "a bool")
    _check_per_token("teacher_logz", logz, lead, lambda d: d in FLOATS, "a floating")
    _check_per_token("labels", labels, lead, lambda d: not d.is_floating_point and d != torch.bool, "an integer")
    devices = {t.device for t in (hidden, weight, bias, ids, logprobs, mask, logz, labels) if t is not None}
    _need(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_per_token(name: str, t, lead: tuple, dtype_ok, dtype_word: str) -> None:
    if t is None:
        return
    _type(isinstance(t, Tensor) and dtype_ok(t.dtype),
          f"{name}: expected {dtype_word} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    _need(tuple(t.shape) == lead, f"{name}: expected shape {lead} (one per token), got {tuple(t.shape)}")


def check_values(ids: Tensor, logprobs: Tensor, logz, labels, vocab: int, tail: str, temperature: float) -> None:
    """Value checks on the counted tokens ([n, K] etc.). Meta tensors (cost-model traces) have no values."""
    if ids.numel() == 0 or ids.device.type == "meta":
        return
    lo, hi = int(ids.min()), int(ids.max())
    _need(lo >= 0 and hi < vocab, f"teacher_ids: expected values in [0, {vocab}), got range [{lo}, {hi}]; "
          "is the cache built for another vocabulary?")
    tempered_logz = logz if (logz is not None and tail == "bucket") else None
    dup_rows, mass, tempered = 0, 0.0, 0.0
    for a in range(0, ids.shape[0], VALUE_CHECK_ROWS):  # blocks: no N x K float64 temporaries
        block = slice(a, a + VALUE_CHECK_ROWS)
        dup_rows += _duplicate_rows(ids[block])
        lp = logprobs[block].double()
        mass = max(mass, lp.exp().sum(-1).max().item())
        if tempered_logz is not None:
            shifted = lp / temperature - tempered_logz[block].double().unsqueeze(-1)
            tempered = max(tempered, shifted.exp().sum(-1).max().item())
    if dup_rows:
        raise ValueError(f"teacher_ids: expected K distinct ids per token, got duplicates in {dup_rows} "
                         "token(s); drop repeated ids")
    bad = ~torch.isfinite(logprobs)
    _need(not bool(bad.any()), f"teacher_logprobs: expected finite values, got {int(bad.sum())} NaN/inf; "
          "mask those tokens out or repair the cache")
    top = float(logprobs.max())
    _need(top <= LOGPROB_SLACK, f"teacher_logprobs: expected log-probabilities (<= 0), got max {top:.4g}; "
          "pass log_softmax(teacher_logits) over the full vocabulary, not raw logits")
    _need(mass <= 1 + MASS_SLACK, f"teacher_logprobs: expected top-K mass <= 1, got {mass:.4g}; normalise over "
          "the full vocabulary at T=1 (log_softmax), not over the top-K")
    if logz is not None:
        _need(bool(torch.isfinite(logz).all()), "teacher_logz: expected finite c_T values, got NaN/inf")
        if tempered_logz is not None:
            _need(tempered <= 1 + MASS_SLACK, f"teacher_logz: tempered top-K mass exp(a/T - c_T) sums to "
                  f"{tempered:.4g} > 1; c_T must be log sum_v exp(a_v/T) over the full vocabulary at T={temperature}")
    if labels is not None:
        valid = labels[labels != -100]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            raise ValueError(f"labels: expected -100 (ignored) or values in [0, {vocab}), got range "
                             f"[{int(valid.min())}, {int(valid.max())}]")


def _duplicate_rows(ids: Tensor) -> int:
    if ids.shape[-1] < 2:
        return 0
    s = ids.sort(dim=-1).values
    return int((s[:, 1:] == s[:, :-1]).any(dim=-1).sum())


def check_triton(dtype: torch.dtype, ce_weight: float, temperature: float) -> None:
    """impl="triton" covers what its kernels compute; everything else is refused with the remedy."""
    from topkd.loss import triton_chunk

    problem = triton_chunk.available()
    _need(problem is None, f"impl='triton': {problem}")
    _need(dtype != torch.float64, "impl='triton': expected fp32/bf16/fp16 inputs (the kernels compute in fp32), "
          "got float64; use impl='fused'")
    _need(not (ce_weight > 0 and temperature != 1.0), f"impl='triton': hard-label CE at temperature={temperature} "
          "needs a second, untempered softmax the kernels do not compute; use impl='fused', or ce_weight=0")


def check_temperature_tail(tail: str, temperature: float, has_logz: bool) -> None:
    _need(tail == "renorm" or temperature == 1.0 or has_logz,
          f"tail='bucket' with temperature={temperature} needs teacher_logz (c_T = log sum_v exp(a_v/T) over the "
          "full vocabulary, stored in the cache at build time), got None; pass teacher_logz, or use tail='renorm' "
          "(exact on the top-K support), or temperature=1")
