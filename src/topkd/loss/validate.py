"""Input checks for fused_linear_kd: every refusal says what was expected, what came, and the fix.

Cheap checks (shapes, dtypes, names, numbers) run on everything; value checks (id range,
duplicates, finite and normalised log-probs) run on the counted tokens only, since masked
rows are padding that users may fill with anything. All are O(N K), never O(N V).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from topkd.base.rows import check_values  # noqa: F401  (the teacher rows' value checks: one home, shared with import)
from topkd.loss.divergences import DIVERGENCES, TAILS

IMPLS = ("fused", "chunked", "dense", "triton")
REDUCTIONS = ("mean", "sum", "none")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _type(ok: bool, message: str) -> None:
    if not ok:
        raise TypeError(message)


def check_names(divergence: str, tail: str, impl: str, reduction: str) -> None:
    for what, value, allowed in (
        ("divergence", divergence, tuple(DIVERGENCES)),
        ("tail", tail, TAILS),
        ("impl", impl, IMPLS),
        ("reduction", reduction, REDUCTIONS),
    ):
        _need(value in allowed, f"{what}: expected one of {allowed}, got {value!r}")
    _need(
        not (divergence == "reverse_kl" and tail == "renorm"),
        "divergence='reverse_kl' needs the teacher tail bucket, got tail='renorm' (the renormalised teacher "
        "has zero mass off its top-K, so KL(Q||P) is infinite); use tail='bucket'",
    )


def check_numbers(
    temperature: float, beta: float, ce_weight: float, divergence: str, chunk_size: int | None
) -> None:
    _need(
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0,
        f"temperature: expected a finite number > 0, got {temperature!r}",
    )
    _need(
        isinstance(ce_weight, (int, float)) and math.isfinite(ce_weight) and ce_weight >= 0,
        f"ce_weight: expected a finite number >= 0, got {ce_weight!r}",
    )
    if divergence == "jsd":
        _need(
            isinstance(beta, (int, float)) and 0 < beta < 1,
            f"beta: expected 0 < beta < 1 for divergence='jsd', got {beta!r}; use 'kl' for beta=0 "
            "and 'reverse_kl' for beta=1",
        )
    _need(
        chunk_size is None or (isinstance(chunk_size, int) and chunk_size >= 1),
        f"chunk_size: expected None (from the byte budget) or an int >= 1, got {chunk_size!r}",
    )


def check_softcap(softcap) -> None:
    _need(
        softcap is None
        or (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0),
        f"softcap: expected None or a finite number > 0 (the model's final_logit_softcapping), got {softcap!r}",
    )


def check_shapes(
    hidden: Tensor,
    weight: Tensor,
    bias,
    ids: Tensor,
    logprobs: Tensor,
    mask,
    logz,
    labels,
    vocab: int | None = None,
) -> None:
    """vocab: the full vocabulary when weight holds only some of its rows (vocab-parallel)."""
    for name, t in (
        ("hidden", hidden),
        ("weight", weight),
        ("teacher_ids", ids),
        ("teacher_logprobs", logprobs),
    ):
        _type(isinstance(t, Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _check_projection(hidden, weight, bias)
    lead = tuple(hidden.shape[:-1])
    _check_teacher_rows(ids, logprobs, lead, vocab or weight.shape[0])
    _check_per_token("mask", mask, lead, lambda d: d == torch.bool, "a bool")
    _check_per_token("teacher_logz", logz, lead, lambda d: d in FLOATS, "a floating")
    _check_per_token(
        "labels", labels, lead, lambda d: not d.is_floating_point and d != torch.bool, "an integer"
    )
    devices = {
        t.device for t in (hidden, weight, bias, ids, logprobs, mask, logz, labels) if t is not None
    }
    _need(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_projection(hidden: Tensor, weight: Tensor, bias) -> None:
    """The student side: hidden [N, H] or [B, T, H], lm_head weight [V, H] (and bias [V]) in hidden's dtype."""
    _type(hidden.dtype in FLOATS, f"hidden: expected a floating dtype {FLOATS}, got {hidden.dtype}")
    _need(
        hidden.dim() in (2, 3),
        f"hidden: expected [N, H] or [B, T, H], got shape {tuple(hidden.shape)}",
    )
    _need(
        weight.dim() == 2 and weight.shape[1] == hidden.shape[-1],
        f"weight: expected [V, {hidden.shape[-1]}] (lm_head.weight, H matching hidden), got {tuple(weight.shape)}",
    )
    _type(
        weight.dtype == hidden.dtype,
        f"weight: expected dtype {hidden.dtype} like hidden, got {weight.dtype}; "
        "cast one of them (nothing is upcast silently)",
    )
    if bias is None:
        return
    rows = weight.shape[0]
    _type(
        isinstance(bias, Tensor) and bias.dtype == hidden.dtype,
        f"bias: expected a {hidden.dtype} tensor, got {getattr(bias, 'dtype', type(bias).__name__)}",
    )
    _need(
        tuple(bias.shape) == (rows,),
        f"bias: expected shape ({rows},) like weight's rows, got {tuple(bias.shape)}",
    )


def _check_teacher_rows(ids: Tensor, logprobs: Tensor, lead: tuple, vocab: int) -> None:
    """The teacher side: integer ids [..., K] with 1 <= K <= V, and constant float log-probs of the same shape."""
    _type(
        not ids.dtype.is_floating_point and ids.dtype != torch.bool and not ids.dtype.is_complex,
        f"teacher_ids: expected an integer dtype, got {ids.dtype}",
    )
    _need(
        ids.dim() == len(lead) + 1 and tuple(ids.shape[:-1]) == lead,
        f"teacher_ids: expected shape {lead + ('K',)} matching hidden, got {tuple(ids.shape)}",
    )
    k = ids.shape[-1]
    _need(1 <= k <= vocab, f"teacher_ids: expected 1 <= K <= V={vocab}, got K={k}")
    _type(
        logprobs.dtype in FLOATS,
        f"teacher_logprobs: expected a floating dtype, got {logprobs.dtype}",
    )
    _need(
        logprobs.shape == ids.shape,
        f"teacher_logprobs: expected shape {tuple(ids.shape)} like teacher_ids, got {tuple(logprobs.shape)}",
    )
    _need(
        not logprobs.requires_grad,
        "teacher_logprobs: the teacher is a constant; got a tensor that requires "
        "grad; pass teacher_logprobs.detach()",
    )


def _check_per_token(name: str, t, lead: tuple, dtype_ok, dtype_word: str) -> None:
    if t is None:
        return
    _type(
        isinstance(t, Tensor) and dtype_ok(t.dtype),
        f"{name}: expected {dtype_word} tensor, got {getattr(t, 'dtype', type(t).__name__)}",
    )
    _need(
        tuple(t.shape) == lead,
        f"{name}: expected shape {lead} (one per token), got {tuple(t.shape)}",
    )


def check_temperature_tail(tail: str, temperature: float, has_logz: bool) -> None:
    _need(
        tail == "renorm" or temperature == 1.0 or has_logz,
        f"tail='bucket' with temperature={temperature} needs teacher_logz (c_T = log sum_v exp(a_v/T) over the "
        "full vocabulary, stored in the cache at build time), got None; pass teacher_logz, or use tail='renorm' "
        "(exact on the top-K support), or temperature=1",
    )
