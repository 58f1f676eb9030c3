"""topkd.hf_on_policy: `topkd train --on-policy` inside Hugging Face Trainer (beside topkd.hf's KDTrainer).

    from topkd.cache.building.teacher import load_teacher       # or served.ServedTeacher(url, tokenizer, vocab, k)
    from topkd.hf_on_policy import OnPolicyKDTrainer
    from topkd.loss import LossOptions

    trainer = OnPolicyKDTrainer(model=student, args=TrainingArguments(output_dir="runs/hf-gkd", ...),
                                teacher=load_teacher("TEACHER"), prompts=["chats.jsonl"], online_k=100,
                                max_new_tokens=64, loss=LossOptions(divergence="reverse_kl"))
    trainer.train()

Each optimizer step is on-policy with probability `fraction` (GKD's lmbda; a pure function of the seed and the
step, so a resumed run chooses as the first did): at its first micro-batch the student completes
per_device_train_batch_size prompts for each of the step's gradient_accumulation_steps micro-batches (the
prompts in topkd train's seeded order), the teacher scores prompt + completion (its top online_k), and those
batches replace the dataloader's; the loss divides by the counted tokens of the whole step, as KDTrainer does.
The rest of the steps train on train_dataset (a TopKDataset of a cache, given for fraction < 1). The prompts, the
generation seeds and the rows are topkd train's (topkd/train/on_policy.py), so both train the same steps (tested
step by step against `topkd train --on-policy`). One process (as topkd train --on-policy); generation time,
scoring time and completion length are logged beside loss.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import transformers

from topkd.cache.building.teacher import TeacherEngine
from topkd.hf import KDTrainerMixin, head_model
from topkd.loss.options import LossOptions
from topkd.train.on_policy import OnPolicy, open_on_policy
from topkd.train.online import OnlineTeacher


class _StepSlots(torch.utils.data.Dataset):
    """The dataloader's items where every step is on-policy: placeholders its batches replace, one per prompt."""

    def __init__(self, prompts: int, vocab_size: int):
        self.prompts, self.vocab_size = prompts, vocab_size

    def __len__(self) -> int:
        return self.prompts

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.zeros(1, dtype=torch.long)}


def _stack(items: list[dict]) -> dict:
    return {"input_ids": torch.stack([item["input_ids"] for item in items])}


class OnPolicyKDTrainer(KDTrainerMixin, transformers.Trainer):
    """KDTrainer whose steps are, with probability fraction, the student's own completions scored by the teacher."""

    def __init__(
        self,
        *args,
        teacher: TeacherEngine,
        prompts: list[str],
        online_k: int = 100,
        max_new_tokens: int = 64,
        seq_len: int = 512,
        fraction: float = 1.0,
        sampling_temperature: float = 1.0,
        sampling_top_p: float = 1.0,
        messages_field: str = "messages",
        loss: LossOptions | None = None,
        **kwargs,
    ):
        args_ = kwargs.get("args") or (args[1] if len(args) > 1 else None)
        seed = getattr(args_, "seed", 42)
        if getattr(args_, "world_size", 1) > 1:
            raise ValueError(
                "OnPolicyKDTrainer: expected one process (generations differ in length, FSDP/DDP need equal "
                "forwards), got several; run it as one process"
            )
        scorer = OnlineTeacher(
            teacher, prompts, seq_len, online_k, [], messages_field=messages_field
        )
        settings = SimpleNamespace(
            data=prompts,
            messages_field=messages_field,
            max_new_tokens=max_new_tokens,
            sampling_temperature=sampling_temperature,
            sampling_top_p=sampling_top_p,
            on_policy_fraction=fraction,
            seed=seed,
        )
        self.kd_on_policy: OnPolicy = open_on_policy(settings, scorer, None)
        if kwargs.get("train_dataset") is None:
            if fraction < 1:
                raise ValueError(
                    f"OnPolicyKDTrainer: fraction={fraction} trains the other steps on train_dataset, got "
                    "none; pass train_dataset=TopKDataset(cache) (or fraction=1)"
                )
            kwargs["train_dataset"] = _StepSlots(len(self.kd_on_policy.prompts), scorer.vocab_size)
            kwargs["data_collator"] = _stack
        super().__init__(*args, loss=loss, **kwargs)
        if self.kd_options.needs_logz:
            raise ValueError(
                "OnPolicyKDTrainer: expected a loss the teacher's top-K rows give at T = 1 (no c_T is "
                f"computed), got temperature={self.kd_options.temperature} with tail='bucket'; pass tail="
                "'renorm' or temperature=1"
            )
        rows = head_model(self.model).get_output_embeddings().weight.shape[0]
        scorer.check_student(rows, self.processing_class)
        self._op_step, self._op_queue, self._op_tokens = -1, [], None
        self._op_before = (
            0,
            0,
        )  # (a step, the on-policy steps before it): counted on, not from 0 each step
        self._op_logged = {
            "steps": 0,
            "generate_s": 0.0,
            "score_s": 0.0,
            "tokens": 0,
            "completions": 0,
        }

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        if not self.kd_on_policy.chooses(step):
            return super().training_step(model, inputs, num_items_in_batch)
        if self._op_step != step:  # the step's first micro-batch: write and score all of them
            self._op_queue, self._op_tokens = self._make_step(model, step)
            self._op_step = step
        inputs = self._prepare_inputs(self._op_queue.pop(0))
        return super().training_step(model, inputs, self._op_tokens)

    def _make_step(self, model, step: int) -> tuple[list[dict], torch.Tensor]:
        policy, size = self.kd_on_policy, self.args.per_device_train_batch_size
        micro = self.args.gradient_accumulation_steps
        done = sum(
            policy.chooses(s) for s in range(step)
        )  # on-policy steps before: their prompts are used
        batches, made = policy.step_batches(
            self.accelerator.unwrap_model(model), done * micro * size, step, micro, size, 1, 0
        )
        logged = self._op_logged
        logged["steps"] += 1
        logged["generate_s"] += made["generate_s"]
        logged["score_s"] += made["score_s"]
        logged["tokens"] += made["generated_tokens"]
        logged["completions"] += made["completions"]
        tokens = sum(b["kd_mask"].sum() for b in batches).to(self.args.device)
        return batches, tokens

    def _on_policy_steps_before(self, step: int) -> int:
        """How many steps before `step` were on-policy (a pure function of the seed: a resumed run counts again)."""
        last, count = self._op_before if self._op_before[0] <= step else (0, 0)
        count += sum(self.kd_on_policy.chooses(s) for s in range(last, step))
        self._op_before = (step, count)
        return count

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Adds the on-policy steps' generation and scoring seconds and mean completion length since the last log."""
        seen = self._op_logged
        if "loss" in logs and seen["steps"]:
            logs["on_policy_steps"] = seen["steps"]
            logs["generate_s"], logs["score_s"] = seen["generate_s"], seen["score_s"]
            logs["completion_len"] = seen["tokens"] / max(seen["completions"], 1)
            self._op_logged = {k: 0 * v for k, v in seen.items()}
        super().log(logs, *args, **kwargs)


__all__ = ["OnPolicyKDTrainer"]
