"""The student: an HF causal LM, optionally cut from the teacher, wrapped so the KD loss runs in forward.

    student = load_student(cfg, cache)         # checks vocabulary and tokenizer against the cache
    loss_sum = KDStudent(student.model, spec)(batch)   # hidden states only; [N, V] logits never exist

The loss is computed inside the module's forward, where a sharding wrapper (FSDP2) would have
gathered the lm_head weight. Student lm_head rows beyond the teacher's vocabulary (padding) are
left out of the projection, so they get no probability mass and no gradient.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from topkd.cache import TopKCache
from topkd.loss import fused_linear_kd, kd_loss, loss_parts
from topkd.loss.fold import fold_beyond
from topkd.loss.options import LossOptions
from topkd.models import final_hidden, load_causal_lm, model_head
from topkd.train.cross import cross_batch_loss
from topkd.train.lora import add_adapters


@dataclass
class Student:
    model: nn.Module
    tokenizer: object


def load_student(cfg, source: TopKCache) -> Student:
    """The student of cfg, checked against the source's teacher (a TopKCache or an OnlineTeacher); with
    cfg.fold_beyond_vocab a head smaller than the cache's ids is accepted (batch_loss folds them)."""
    if cfg.init_from_teacher:
        teacher = source.load_teacher()
        model, tokenizer = cut_layers(teacher.model, cfg.layers), teacher.tokenizer
    else:
        model, tokenizer = load_causal_lm(cfg.student, "float32", "cpu", role="student")
    rows = model.get_output_embeddings().weight.shape[0]
    source.check_student(
        vocab_size=max(rows, source.vocab_size) if cfg.fold_beyond_vocab else rows,
        tokenizer=tokenizer,
    )
    model.config.use_cache = False
    model = model.float().train()
    if cfg.lora_rank:  # adapters on the body; every base weight and the lm_head frozen
        model = add_adapters(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    return Student(model=model, tokenizer=tokenizer)


def cut_layers(model: nn.Module, keep: int) -> nn.Module:
    """A copy of a decoder LM with `keep` evenly spaced layers (first and last kept); embeddings, norms, head copied."""
    layers = model.get_decoder().layers
    n = len(layers)
    if not 1 <= keep <= n:
        raise ValueError(f"layers: expected 1..{n} (the teacher has {n}), got {keep}")
    chosen = [round(i * (n - 1) / (keep - 1)) for i in range(keep)] if keep > 1 else [n - 1]
    student = copy.deepcopy(model)
    student.get_decoder().layers = nn.ModuleList([student.get_decoder().layers[i] for i in chosen])
    for new_idx, layer in enumerate(student.get_decoder().layers):
        if hasattr(getattr(layer, "self_attn", None), "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    student.config.num_hidden_layers = keep
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in chosen]
    return student


class KDStudent(nn.Module):
    """Owns the student; forward(batch) returns the summed KD (+ CE) loss of the batch's counted tokens.

    options (a LossOptions) configure the loss (its reduction is always the batch's sum); objective="ce" trains
    on hard labels only (the no-teacher baseline); top_k > 0 distils from the first top_k columns of the
    (rank-ordered) rows."""

    def __init__(
        self,
        model: nn.Module,
        teacher_vocab: int,
        options: LossOptions,
        activation_checkpointing: bool = False,
        objective: str = "kd",
        top_k: int = 0,
        head_dtype: torch.dtype = torch.float32,
        fold_beyond_vocab: bool = False,
    ):
        super().__init__()
        if not isinstance(options, LossOptions):
            raise TypeError(
                f"KDStudent: expected options=topkd.LossOptions(...), got {type(options).__name__}"
            )
        # Gemma-2 style: the loss caps too
        softcap = getattr(model.config, "final_logit_softcapping", None) or None
        if softcap and objective == "ce":
            raise ValueError(
                f"objective='ce': expected a student without final logit soft-capping, got "
                f"final_logit_softcapping={softcap} (torch's linear cross entropy cannot cap); use "
                "objective='kd' with ce_weight, which caps"
            )
        self.model, self.teacher_vocab = model, teacher_vocab
        self.options = options  # batch_loss adds the model's own soft-cap
        self.objective, self.top_k = objective, top_k
        # bf16: the loss's GEMMs in bf16 (fp32 accumulation inside the loss)
        self.head_dtype = head_dtype
        self.fold_beyond_vocab = fold_beyond_vocab
        if activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

    def forward(
        self, batch: dict[str, torch.Tensor], monitor: LossOptions | None = None
    ) -> torch.Tensor:
        """The batch's summed loss; with monitor, also another loss on the same hidden states, for the log only
        (no gradient, not in loss_parts): self.monitored."""
        hidden = final_hidden(self.model, batch["input_ids"], batch["position_ids"])
        loss = self._loss(hidden, batch, self.options)
        if monitor is not None:
            with torch.no_grad(), loss_parts():
                self.monitored = self._loss(hidden.detach(), batch, monitor)
        return loss

    def _loss(self, hidden: torch.Tensor, batch: dict, options: LossOptions) -> torch.Tensor:
        return batch_loss(
            self.model,
            hidden,
            batch,
            options,
            self.teacher_vocab,
            self.top_k,
            self.head_dtype,
            self.objective,
            self.fold_beyond_vocab,
        )


def batch_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    batch: dict[str, torch.Tensor],
    options: LossOptions,
    teacher_vocab: int | None = None,
    top_k: int = 0,
    head_dtype: torch.dtype = torch.float32,
    objective: str = "kd",
    fold_beyond_vocab: bool = False,
) -> torch.Tensor:
    """The summed KD (+ CE) loss of a batch's counted tokens from the student's final hidden states and its head
    (topkd train's KDStudent and topkd.hf's trainer both end here). An FSDP2-sharded head weight (a DTensor) is
    gathered with a gradient back to its shards; rows beyond the teacher's vocabulary are left out."""
    weight, bias, softcap = model_head(model)
    weight, bias = _gathered(weight), None if bias is None else _gathered(bias)
    vocab = teacher_vocab or weight.shape[0]
    # the casts' backward returns dW to the fp32 master weights
    weight = weight[:vocab].to(head_dtype)
    bias = None if bias is None else bias[:vocab].to(head_dtype)
    if objective == "ce":
        return linear_cross_entropy_sum(
            hidden.to(head_dtype).reshape(-1, hidden.shape[-1]),
            weight,
            bias,
            batch["labels"].reshape(-1),
        )
    if "cross_kind" in batch:  # a CrossTokenizerSource's samples (--cross-tokenizer)
        if bias is not None or softcap:
            raise ValueError(
                "--cross-tokenizer: expected a student head without bias or logit soft-capping, got "
                f"bias={bias is not None}, softcap={softcap}; the cross-tokenizer loss has neither"
            )
        return cross_batch_loss(hidden.to(head_dtype), weight, batch, options.ce_weight)
    opts = dataclasses.replace(options, softcap=softcap, reduction="sum")
    logz = batch["teacher_logz"] if opts.needs_logz else None
    labels = batch["labels"] if opts.needs_labels else None
    keep = top_k or None
    ids, logprobs = batch["teacher_ids"][..., :keep], batch["teacher_logprobs"][..., :keep]
    if fold_beyond_vocab:
        weight, bias, ids, logprobs = fold_beyond(weight, bias, ids, logprobs)
    return kd_loss(
        hidden.to(head_dtype),
        weight,
        ids,
        logprobs,
        opts,
        mask=batch["kd_mask"],
        teacher_logz=logz,
        labels=labels,
        bias=bias,
    )


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> torch.Tensor:
    """Summed CE of hidden @ weight.T (+ bias) at labels (-100 ignored), never forming [N, V]: torch's fused
    linear cross entropy where this torch has it (>= 2.12), else topkd's fused loss at K = 1 (the label with
    teacher probability 1, so the bucket KL is -log q_label: exactly CE)."""
    if hasattr(torch.nn.functional, "linear_cross_entropy"):
        return torch.nn.functional.linear_cross_entropy(
            hidden, weight, labels, linear_bias=bias, reduction="sum", ignore_index=-100
        )
    counted = labels != -100
    ids = torch.where(counted, labels, 0)[:, None]
    logprobs = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    return fused_linear_kd(hidden, weight, ids, logprobs, mask=counted, bias=bias, reduction="sum")


def _gathered(param: torch.Tensor) -> torch.Tensor:
    """A whole tensor: FSDP2 keeps sharded parameters as DTensors outside their module's forward."""
    from torch.distributed.tensor import DTensor

    # DeepSpeed ZeRO-3: an empty placeholder outside its forward
    if hasattr(param, "ds_id") and param.numel() == 0:
        raise ValueError(
            "lm_head: expected the weight itself, got a DeepSpeed ZeRO-3 partition (empty outside the "
            "module's forward); shard with FSDP2 (fully_shard), whose DTensor weight topkd gathers"
        )
    return param.full_tensor() if isinstance(param, DTensor) else param
