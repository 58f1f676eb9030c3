"""topkd.hf: distil inside Hugging Face Trainer or TRL's SFTTrainer, from a top-K cache, with the fused loss.

    from topkd.cache import TopKCache
    from topkd import TopKDataset
    from topkd.hf import KDTrainer
    from topkd.loss import LossOptions

    trainer = KDTrainer(model=student, args=TrainingArguments(output_dir="runs/hf", ...),
                        train_dataset=TopKDataset("runs/cache", seq_len=2048),   # temperature=T: tempered KD
                        loss=LossOptions(divergence="kl", tail="bucket", ce_weight=0.1))
    trainer.train()

    from topkd.hf_on_policy import OnPolicyKDTrainer      # GKD: the student's own completions (that module)

    class KDSFTTrainer(KDTrainerMixin, trl.SFTTrainer):           # the same loss in TRL's SFTTrainer, which
        pass                                                     # takes `datasets` only: as_hf_dataset(data)

compute_loss runs the model for its final hidden states only (logits for one position: never [B, T, V]), finds
the lm_head through PEFT and DDP/FSDP wrappers, gathers an FSDP2-sharded head weight (DTensor) for the loss
with a gradient back to its shards, and divides the summed loss by the counted tokens (kd_mask) of the whole
optimizer step on every process (num_items_in_batch), as `topkd train` does: gradient accumulation 1x4 and 4x1
give the same step. The teacher columns survive remove_unused_columns; a TopKDataset is read in its own
(seeded) order; kd_loss and ce_loss (per counted token) are logged beside loss. The options are one
topkd.LossOptions, the fields of fused_linear_kd's keywords.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import transformers

from topkd.cache.reading.dataset import EpochSampler, TopKDataset
from topkd.data.samples import EXTRA_ROW_KEYS, SequenceSource, collate
from topkd.loss import loss_parts
from topkd.loss.options import LossOptions
from topkd.train.student import batch_loss

LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossOptions))
KD_COLUMNS = (
    "position_ids",
    "labels",
    "kd_mask",
    "teacher_ids",
    "teacher_logprobs",
    "teacher_logz",
    *EXTRA_ROW_KEYS,  # a cross-tokenizer source's rows (topkd.train.cross)
)


class KDTrainerMixin:
    """compute_loss, column keeping, sampling and logging for a transformers.Trainer subclass (KDTrainer, or
    yours with TRL's SFTTrainer). The loss is configured by loss=LossOptions(...), the object topkd train builds
    from its flags and topkd.loss.kd_loss takes; top_k and fold_beyond_vocab pick the rows; the rest goes to the
    Trainer."""

    loss_is_scaled_for_ga = True  # compute_loss already divides by the whole step's counted tokens

    def __init__(
        self,
        *args,
        loss: LossOptions | None = None,
        top_k: int = 0,
        fold_beyond_vocab: bool = False,
        **kwargs,
    ):
        stray = [name for name in LOSS_FIELDS if name in kwargs]
        if stray:  # the keywords KDTrainer took before one LossOptions configured every loss
            given = ", ".join(f"{name}={kwargs[name]!r}" for name in stray)
            raise TypeError(
                f"KDTrainer: expected the loss's options in one LossOptions, got {given} as keywords; "
                f"pass loss=topkd.LossOptions({given})"
            )
        if loss is not None and not isinstance(loss, LossOptions):
            raise TypeError(
                f"KDTrainer: expected loss=topkd.LossOptions(...), got {type(loss).__name__}"
            )
        if kwargs.get("data_collator") is None:
            kwargs["data_collator"] = collate
        super().__init__(*args, **kwargs)
        self.kd_options = kd_options(loss, self.train_dataset)
        self.kd_top_k, self.kd_fold = top_k, fold_beyond_vocab
        check_student_against_cache(
            self.model, self.train_dataset, self.processing_class, fold_beyond_vocab
        )
        check_sampled_targets(self.train_dataset, self.kd_options, top_k)
        # tensors on the device once a step adds to them
        self._kd_logged = {"kd": 0.0, "ce": 0.0, "tokens": 0.0}

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *KD_COLUMNS]))

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if isinstance(dataset, TopKDataset):  # several processes: accelerate shards its batches
            # its order is already topkd train's seeded one, epoch by epoch
            return EpochSampler(dataset)
        return super()._get_train_sampler(train_dataset)

    def _get_num_items_in_batch(
        self, batch_samples: list, device: torch.device
    ) -> torch.Tensor | None:
        """The step's counted tokens (kd_mask) over all its micro-batches and processes: the loss's divisor."""
        if not batch_samples or "kd_mask" not in batch_samples[0]:
            return super()._get_num_items_in_batch(batch_samples, device)
        count = sum(b["kd_mask"].sum() for b in batch_samples).to(device)
        return self.accelerator.gather(count).sum() if self.args.world_size > 1 else count

    def compute_loss(
        self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None
    ):
        missing = [c for c in ("kd_mask", "teacher_ids", "teacher_logprobs") if c not in inputs]
        if missing:
            raise ValueError(
                f"KDTrainer: expected batches with the teacher's columns, got none of {missing} (keys "
                f"{sorted(inputs)}); train on a topkd.TopKDataset collated by topkd.collate"
            )
        if self.kd_options.needs_logz and "teacher_logz" not in inputs:
            raise ValueError(
                f"KDTrainer: temperature={self.kd_options.temperature} with tail='bucket' needs "
                "teacher_logz; build the dataset with TopKDataset(cache, temperature=T)"
            )
        hidden = final_hidden_states(model, inputs)
        with loss_parts() as parts:
            total = batch_loss(
                head_model(model),
                hidden,
                inputs,
                self.kd_options,
                self.kd_teacher_vocab(),
                self.kd_top_k,
                fold_beyond_vocab=self.kd_fold,
            )
        tokens = inputs["kd_mask"].sum() if num_items_in_batch is None else num_items_in_batch
        loss = total / tokens.clamp(min=1)
        if self.args.world_size > 1:
            # DDP/FSDP average gradients over processes; tokens are global
            loss = loss * self.args.world_size
        seen = self._kd_logged  # summed where they are: read (one sync) only when the Trainer logs
        seen["kd"], seen["ce"] = (
            seen["kd"] + parts["kd"].detach(),
            seen["ce"] + parts["ce"].detach(),
        )
        seen["tokens"] = seen["tokens"] + inputs["kd_mask"].sum()
        return (loss, {"loss": loss}) if return_outputs else loss

    def kd_teacher_vocab(self) -> int | None:
        """The cache's vocabulary (a TopKDataset knows it): student head rows beyond it are padding, left out."""
        return getattr(self.train_dataset, "vocab_size", None)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Adds kd_loss and ce_loss (per counted token since the last log, this process) beside loss."""
        seen = {name: float(value) for name, value in self._kd_logged.items()}
        if "loss" in logs and seen["tokens"]:
            logs["kd_loss"] = seen["kd"] / seen["tokens"]
            if self.kd_options.needs_labels:
                logs["ce_loss"] = seen["ce"] / seen["tokens"]
            self._kd_logged = {"kd": 0.0, "ce": 0.0, "tokens": 0.0}
        super().log(logs, *args, **kwargs)


class KDTrainer(KDTrainerMixin, transformers.Trainer):
    """transformers.Trainer distilling from a top-K cache with topkd's fused loss (see the module docstring)."""


def kd_options(loss: LossOptions | None, dataset) -> LossOptions:
    """The loss's options against the dataset's temperature: a TopKDataset built with temperature=T carries c_T for
    T; without loss= KDTrainer takes T from it, and a loss= whose temperature differs is refused here, not at the
    first step. The reduction is KDTrainer's own (the step's sum over its counted tokens)."""
    dataset = _topk_dataset(dataset)
    carried = None if dataset is None else dataset.temperature
    if loss is None:
        loss = LossOptions(temperature=float(carried) if carried is not None else 1.0)
    given = loss.temperature
    if carried is not None and given != float(carried):
        raise ValueError(
            f"KDTrainer: loss.temperature={given}, but the dataset carries c_T for T={carried} "
            f"(TopKDataset(temperature=...)); pass loss=LossOptions(temperature={carried}, ...)"
        )
    if dataset is not None and given != 1.0 and loss.needs_logz and carried is None:
        raise ValueError(
            f"KDTrainer: loss.temperature={given} with tail='bucket' needs c_T; build the dataset with "
            f"TopKDataset(cache, temperature={given})"
        )
    return dataclasses.replace(loss, reduction="sum")


def check_student_against_cache(
    model, dataset, tokenizer=None, fold_beyond_vocab: bool = False
) -> None:
    """As `topkd train` does: a TopKDataset of a cache refuses a student whose head cannot hold the cache's ids or
    whose tokenizer gives other ids (Llama-2 and Mistral-7B share V=32,000, not their tokens). The tokenizer is
    the processing_class, else the one saved beside the model (config._name_or_path); without either, only the
    vocabulary is checked, and a warning says so."""
    cache = _dataset_source(dataset)
    if cache is None:
        return  # not a TopKDataset (a `datasets` copy): nothing recorded to check against
    head = head_model(model)
    rows = int(head.get_output_embeddings().weight.shape[0])
    tokenizer = tokenizer if hasattr(tokenizer, "get_vocab") else _saved_tokenizer(head)
    if tokenizer is None:
        print(
            "KDTrainer: warning: the student's tokenizer is unknown (no processing_class, none saved beside the "
            "model), so only its vocabulary size was checked against the cache; pass processing_class=tokenizer",
            file=sys.stderr,
            flush=True,
        )
    cache.check_student(
        vocab_size=max(rows, cache.vocab_size) if fold_beyond_vocab else rows, tokenizer=tokenizer
    )


def check_sampled_targets(dataset, options: LossOptions, top_k: int) -> None:
    """As `topkd train` does: a TopKDataset of a sampled cache refuses the options its targets cannot train with."""
    cache = _dataset_source(dataset)
    if cache is None:
        return
    problem = cache.target_kind.training_problem(options.divergence, options.temperature, top_k)
    if problem:
        raise ValueError(
            f"KDTrainer: the dataset's cache {cache.path} holds {problem}; pass "
            "loss=LossOptions(divergence='kl') (or 'jsd', 'tvd') at temperature 1 and no top_k, or a "
            "top-K cache's TopKDataset"
        )


def _saved_tokenizer(model):
    from transformers import AutoTokenizer

    where = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not os.path.isdir(where):
        return None
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, TypeError):
        return None


def as_hf_dataset(data: TopKDataset):
    """A lazy `datasets.IterableDataset` of data's items in order, epoch after epoch (for TRL's SFTTrainer, which
    takes `datasets` only; pass SFTConfig(max_steps=..., dataset_kwargs={"skip_prepare_dataset": True})).
    Nothing is copied: items are decoded from the cache as they are read."""
    import itertools

    import datasets

    def items():
        for index in itertools.count():
            yield {name: t.numpy() for name, t in data[index].items()}

    out = datasets.IterableDataset.from_generator(items).with_format("torch")
    # what KDTrainer checks the student against, and takes the temperature from
    out.topkd_dataset = data
    return out


def _topk_dataset(dataset):
    """The TopKDataset behind a train_dataset: itself, or the one as_hf_dataset wrapped (None: neither)."""
    dataset = getattr(dataset, "topkd_dataset", dataset)
    return dataset if isinstance(dataset, TopKDataset) else None


def _dataset_source(dataset) -> SequenceSource | None:
    """The sequence source (a cache, an online teacher) behind a train_dataset; None: not a TopKDataset's."""
    topk = _topk_dataset(dataset)
    return None if topk is None else topk.stream.source


def head_model(model):
    """The causal LM under DDP/FSDP/PEFT wrappers: the module whose get_output_embeddings() is the lm_head."""
    while hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
        model = model.module  # DDP, DataParallel
    # PEFT: the head of the base model, frozen or not
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def final_hidden_states(model, inputs: dict) -> torch.Tensor:
    """[B, T, H] final (normed) hidden states through the model's own forward (so DDP and FSDP see a forward and
    gather what they shard), with logits for one position only."""
    out = model(
        input_ids=inputs["input_ids"],
        position_ids=inputs.get("position_ids"),
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
        return_dict=True,
    )
    return out.hidden_states[-1]


__all__ = [
    "KDTrainer",
    "KDTrainerMixin",
    "KD_COLUMNS",
    "as_hf_dataset",
]  # and OnPolicyKDTrainer (lazy)
