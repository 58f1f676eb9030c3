"""Public loss API: `fused_linear_kd` (one function) and `KDLoss` (a thin nn.Module over it).

    loss = topkd.fused_linear_kd(hidden, lm_head.weight, teacher_ids, teacher_logprobs)

hidden [N, H] or [B, T, H]; weight [V, H]; teacher_ids / teacher_logprobs [..., K] (log p at
T=1 over the full teacher vocabulary). See docs/loss.md for the math and every option.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from topkd.loss import validate
from topkd.loss.baselines import chunked_linear_kd, dense_linear_kd
from topkd.loss.chunk import TORCH_KERNELS, Kernels, LossSpec, TeacherRows, with_padding
from topkd.loss.fused import FusedLinearKD, Plan, chunk_rows
from topkd.loss.options import LossOptions
from topkd.loss.vocab_parallel import VocabParallel, shard_for


def fused_linear_kd(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    mask: Tensor | None = None,
    teacher_logz: Tensor | None = None,
    divergence: str = "kl",
    tail: str = "bucket",
    temperature: float = 1.0,
    beta: float = 0.5,
    labels: Tensor | None = None,
    ce_weight: float = 0.0,
    reduction: str = "mean",
    impl: str = "fused",
    chunk_size: int | None = None,
    bias: Tensor | None = None,
    vocab_parallel: VocabParallel | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Top-K knowledge-distillation loss of the student projection `hidden @ weight.T (+ bias)`.

    Returns KD (x T^2) + ce_weight * CE(labels). "mean": KD averaged over counted tokens
    plus CE averaged over counted tokens with a label != -100; "sum": sums; "none": per
    token, shaped like hidden[..., 0], zero where masked. Masked tokens cost no FLOPs; an
    all-masked batch gives 0 with zero gradients. The loss is fp32 for low-precision inputs.
    impl: "fused" (default, never forms [N, V]; Triton passes on a GPU where they apply), "chunked" or
    "dense" (baselines), "triton" (fused, Triton passes required; CUDA).
    chunk_size: rows per chunk; default from the device's budget for the chunk's buffers (CPU 256 MiB, GPU 1 GiB).
    vocab_parallel: weight holds only rows [start, start + rows) of the vocabulary, split across a process
    group (topkd.loss.vocab_parallel); impl="fused" only.
    softcap: the student's logits are softcap * tanh(z / softcap) (Gemma-2's final_logit_softcapping), z the
    projection; the loss and its gradients are those of the capped logits.
    Under torch.autocast the loss still computes in its inputs' dtypes: it picks its own precision.
    """
    options = LossOptions(
        divergence, tail, temperature, beta, ce_weight, reduction, impl, chunk_size, softcap
    )
    return kd_loss(
        hidden,
        weight,
        teacher_ids,
        teacher_logprobs,
        options,
        mask=mask,
        teacher_logz=teacher_logz,
        labels=labels,
        bias=bias,
        vocab_parallel=vocab_parallel,
    )


def kd_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    options: LossOptions,
    *,
    mask: Tensor | None = None,
    teacher_logz: Tensor | None = None,
    labels: Tensor | None = None,
    bias: Tensor | None = None,
    vocab_parallel: VocabParallel | None = None,
) -> Tensor:
    """fused_linear_kd with its options already gathered in a (validated) LossOptions; the impl is chosen here."""
    # not a tensor: refused inside
    device_type = hidden.device.type if isinstance(hidden, Tensor) else "meta"
    # meta (cost-model traces) has no autocast
    no_autocast = (
        torch.autocast(device_type, enabled=False)
        if torch.amp.is_autocast_available(device_type)
        else contextlib.nullcontext()
    )
    with no_autocast:  # autocast's bf16 GEMMs would mix dtypes in dX/dW
        return _dispatch(
            StudentSide(hidden, weight, bias, labels),
            TeacherSide(teacher_ids, teacher_logprobs, teacher_logz, mask),
            options=options,
            vocab_parallel=vocab_parallel,
        )


@dataclass(frozen=True)
class StudentSide:
    """The student's half of a loss call: final hidden states, its lm_head (weight, bias), the CE labels."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None
    labels: Tensor | None = None


@dataclass(frozen=True)
class TeacherSide:
    """The teacher's half: its sparse rows (ids, log-probs, c_T per token) and which tokens count (mask)."""

    ids: Tensor
    logprobs: Tensor
    logz: Tensor | None = None
    mask: Tensor | None = None


def _dispatch(
    student: StudentSide,
    teacher: TeacherSide,
    *,
    options: LossOptions,
    vocab_parallel: VocabParallel | None,
) -> Tensor:
    impl = options.impl
    if impl == "triton":
        from topkd.loss import triton_chunk  # Triton is imported only where it is asked for

        triton_chunk.check_inputs(
            student.hidden.dtype, options.ce_weight, float(options.temperature)
        )
    if vocab_parallel is not None and impl != "fused":
        raise ValueError(
            f"vocab_parallel: expected impl='fused' (the driver that shards the vocabulary), got "
            f"impl={impl!r}"
        )
    x, plan = build_plan(student, teacher, options=options, vocab_parallel=vocab_parallel)
    lead = student.hidden.shape[:-1]
    if impl in ("fused", "triton"):
        return run_fused(x, student.weight, student.bias, plan, lead)
    counted = x if plan.row_index is None else x.index_select(0, plan.row_index)
    weight, bias = student.weight, student.bias
    if impl == "chunked":
        loss = chunked_linear_kd(
            counted, weight, bias, plan.rows, plan.spec, options.reduction, plan.chunk
        )
    else:
        loss = dense_linear_kd(counted, weight, bias, plan.rows, plan.spec, options.reduction)
    if options.reduction != "none":
        return loss
    return scatter_tokens(loss, plan.row_index, x.shape[0]).reshape(lead)


KERNELS_ENV = "TOPKD_FUSED_KERNELS"  # auto | torch | triton: what impl="fused" runs (torch: bisect a kernel bug)


def kernels_for(impl: str, hidden: Tensor, spec: LossSpec) -> Kernels:
    """The full-width chunk passes, chosen once per call. impl="triton": Triton (validated before). impl="fused":
    Triton on a GPU where its kernels cover the call (one read for the softmax statistics, one read + write for
    dL/dz), the torch ops (the reference) everywhere else."""
    choice = "triton" if impl == "triton" else os.environ.get(KERNELS_ENV, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{KERNELS_ENV}: expected auto, torch or triton, got {choice!r}")
    if choice == "auto":
        covered = (
            hidden.device.type in ("cuda", "meta")
            and hidden.dtype != torch.float64
            and not (spec.ce_weight > 0 and spec.temperature != 1.0)
        )
        choice = "triton" if covered and _triton_here(hidden.device.type) else "torch"
    if choice == "torch":
        return TORCH_KERNELS
    from topkd.loss.triton_chunk import TRITON_KERNELS

    return TRITON_KERNELS


def _triton_here(device_type: str) -> bool:
    from topkd.loss import triton_chunk

    problem = triton_chunk.available()
    if problem and device_type == "cuda":
        warnings.warn(
            f"impl='fused' on CUDA runs its softmax passes as torch ops (~15% slower): {problem}",
            stacklevel=4,
        )
    return problem is None


def run_fused(
    x: Tensor, weight: Tensor, bias: Tensor | None, plan: Plan, lead: torch.Size
) -> Tensor:
    """The fused driver under autograd on build_plan()'s outputs; "none" is scattered back to shape `lead`."""
    loss = FusedLinearKD.apply(x, weight, bias, plan)
    return (
        loss
        if plan.spec.reduction != "none"
        else scatter_tokens(loss, plan.row_index, x.shape[0]).reshape(lead)
    )


def build_plan(
    student: StudentSide,
    teacher: TeacherSide,
    *,
    options: LossOptions,
    vocab_parallel: VocabParallel | None = None,
) -> tuple[Tensor, Plan]:
    """Validate, then (the 2-D hidden, the call's whole Plan): counted rows, their TeacherRows, LossSpec, chunk
    rows, and for the fused driver its vocabulary shard or kernels and whether gradients are wanted. The one
    place a Plan is made; weight may hold only some of the vocabulary's rows (vocab-parallel)."""
    hidden, weight = student.hidden, student.weight
    vocab = weight.shape[0] if vocab_parallel is None else vocab_parallel.vocab_size
    validate.check_shapes(
        hidden,
        weight,
        student.bias,
        teacher.ids,
        teacher.logprobs,
        teacher.mask,
        teacher.logz,
        student.labels,
        vocab,
    )
    options.check_inputs(teacher.logz is not None, student.labels is not None)
    x = hidden.reshape(-1, hidden.shape[-1])
    row_index = None if teacher.mask is None else teacher.mask.reshape(-1).nonzero().squeeze(1)
    if row_index is not None and row_index.numel() == x.shape[0]:
        row_index = None  # nothing masked: contiguous slices, no gathers
    rows = _counted_rows(teacher, student.labels if options.needs_labels else None, row_index)
    validate.check_values(
        rows.ids,
        rows.logprobs,
        rows.logz,
        rows.labels,
        vocab,
        options.tail,
        float(options.temperature),
    )
    rows = with_padding(rows)  # variable K: -inf entries are padding
    k = teacher.ids.shape[-1]
    spec = LossSpec(**options.kwargs(), full_support=(k == vocab and rows.padding is None))
    chunk = options.chunk_size or chunk_rows(
        weight.shape[0], hidden.dtype, spec, rows.labels is not None, hidden.device.type
    )
    driver = {}  # what the fused driver alone needs: a vocabulary shard, or its kernels
    if options.impl in ("fused", "triton") and vocab_parallel is not None:
        # the torch passes: the Triton kernels see whole rows only
        driver["vocab"] = shard_for(vocab_parallel, weight, len(rows), chunk)
    elif options.impl in ("fused", "triton"):
        driver["kernels"] = kernels_for(options.impl, hidden, spec)
    return x, Plan(row_index, rows, spec, chunk, grad_wanted=_grad_wanted(student), **driver)


def _grad_wanted(student: StudentSide) -> bool:
    tensors = (student.hidden, student.weight, student.bias)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _counted_rows(teacher: TeacherSide, labels, row_index) -> TeacherRows:
    k = teacher.ids.shape[-1]
    rows = TeacherRows(
        teacher.ids.reshape(-1, k),
        teacher.logprobs.reshape(-1, k),
        None if teacher.logz is None else teacher.logz.reshape(-1),
        None if labels is None else labels.reshape(-1),
    )
    return rows if row_index is None else rows.map(lambda t: t.index_select(0, row_index))


def scatter_tokens(per_token: Tensor, row_index: Tensor | None, n_all: int) -> Tensor:
    if row_index is None:
        return per_token
    return per_token.new_zeros(n_all).index_put((row_index,), per_token)


class KDLoss(nn.Module):
    """nn.Module over fused_linear_kd; options fixed (and validated) at construction, tensors per call."""

    def __init__(
        self,
        *,
        divergence: str = "kl",
        tail: str = "bucket",
        temperature: float = 1.0,
        beta: float = 0.5,
        ce_weight: float = 0.0,
        reduction: str = "mean",
        impl: str = "fused",
        chunk_size: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.options = LossOptions(
            divergence, tail, temperature, beta, ce_weight, reduction, impl, chunk_size, softcap
        )

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        teacher_ids: Tensor,
        teacher_logprobs: Tensor,
        *,
        mask: Tensor | None = None,
        teacher_logz: Tensor | None = None,
        labels: Tensor | None = None,
        bias: Tensor | None = None,
        vocab_parallel: VocabParallel | None = None,
    ) -> Tensor:
        return kd_loss(
            hidden,
            weight,
            teacher_ids,
            teacher_logprobs,
            self.options,
            mask=mask,
            teacher_logz=teacher_logz,
            labels=labels,
            bias=bias,
            vocab_parallel=vocab_parallel,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.kwargs().items())
