"""topkd.hf_on_policy.OnPolicyKDTrainer: inside HF Trainer, the steps of `topkd train --on-policy` (the same prompts,
completions and losses, step by step, with topkd train's optimizer and schedule); what it cannot run is refused
before training."""

import pytest
import torch

from tests.train.runs import losses
from tests.train.test_on_policy import config
from topkd.cache.building.teacher import load_teacher
from topkd.loss import LossOptions
from topkd.train import train
from topkd.train.optim import lr_factor, param_groups
from topkd.train.student import cut_layers

transformers = pytest.importorskip("transformers")
from topkd.hf_on_policy import OnPolicyKDTrainer  # noqa: E402


def _trainer(teacher_dir, chats_file, out, cfg, **kw):
    teacher = load_teacher(teacher_dir)
    model = cut_layers(teacher.model, cfg.layers).float().train()
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size,
        logging_steps=1,
        max_grad_norm=cfg.clip,
        seed=cfg.seed,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    return OnPolicyKDTrainer(
        model=model,
        args=args,
        optimizers=(optimizer, scheduler),
        processing_class=teacher.tokenizer,
        teacher=teacher,
        prompts=[chats_file],
        online_k=cfg.online_k,
        max_new_tokens=cfg.max_new_tokens,
        seq_len=cfg.seq_len,
        loss=LossOptions(divergence=cfg.divergence),
        **kw,
    )


def test_its_steps_are_topkd_trains_on_policy_steps(chat_teacher_dir, chats_file, tmp_path):
    cfg = config(chat_teacher_dir, chats_file, tmp_path / "topkd")
    train(cfg)
    trainer = _trainer(chat_teacher_dir, chats_file, tmp_path / "hf", cfg)
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["loss"] for row in logs] == pytest.approx(losses(tmp_path / "topkd"), rel=1e-4)
    assert all(row["on_policy_steps"] == 1 and row["completion_len"] > 0 for row in logs)


def test_a_fraction_below_one_needs_the_offline_data(chat_teacher_dir, chats_file, tmp_path):
    cfg = config(chat_teacher_dir, chats_file, tmp_path / "topkd")
    with pytest.raises(ValueError, match="fraction=0.5 trains the other steps on train_dataset"):
        _trainer(chat_teacher_dir, chats_file, tmp_path / "hf", cfg, fraction=0.5)
