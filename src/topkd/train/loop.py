"""`topkd train`: train a student against a top-K cache with the fused KD loss.

    topkd train --cache runs/cache --init-from-teacher --layers 6 --out runs/student --steps 500

Single process. Each optimizer step takes grad_accum micro-batches whose summed loss is divided
by the counted tokens of the whole step, so accumulation changes nothing but memory. AdamW
(no decay on norms and biases), linear warmup then cosine, gradient clipping. Checkpoints
(model, optimizer, scheduler, RNG, samples consumed) are written to a temp directory and
renamed; a rerun of the same command resumes from the newest one and continues the exact loss
trajectory. Outputs in --out: metrics.jsonl, loss.png, final/ (save_pretrained, safetensors).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from topkd.cache import TopKCache
from topkd.train import checkpoint as ckpt
from topkd.train.batches import SampleStream, count_tokens, logz_column
from topkd.train.config import TrainConfig, check_config
from topkd.train.student import KDStudent, load_student


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the final metrics row."""
    check_config(cfg)
    torch.manual_seed(cfg.seed)
    cache = TopKCache(cfg.cache)
    seq_len = cfg.seq_len or int(cache.manifest["build"]["seq_len"])
    student = load_student(cfg, cache)
    stream = SampleStream(cache, seq_len, cfg.seed, logz_column(cache, cfg.temperature, cfg.tail))
    options = dict(divergence=cfg.divergence, tail=cfg.tail, temperature=cfg.temperature, beta=cfg.beta,
                   ce_weight=cfg.ce_weight, impl=cfg.impl)
    module = KDStudent(student.model, cache.vocab_size, options, cfg.activation_checkpointing)
    optimizer = torch.optim.AdamW(param_groups(student.model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    state = {"step": 0, "samples": 0}
    os.makedirs(cfg.out, exist_ok=True)
    resumed = ckpt.load_latest(cfg.out, student.model, optimizer, scheduler, state)
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    ckpt.truncate_metrics(metrics_path, state["step"])  # rows past the checkpoint will be recomputed
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    row = {}
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="train" + (" (resumed)" if resumed else ""), unit="step")
    while state["step"] < cfg.steps:
        row = train_step(module, stream, optimizer, scheduler, cfg, state)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", GiB=f"{row['peak_gib']:.2f}")
        if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every == 0 and state["step"] < cfg.steps:
            ckpt.save(cfg.out, student.model, optimizer, scheduler, state)
    bar.close()
    ckpt.save(cfg.out, student.model, optimizer, scheduler, state)
    student.model.save_pretrained(os.path.join(cfg.out, "final"))
    student.tokenizer.save_pretrained(os.path.join(cfg.out, "final"))
    plot_losses(metrics_path, os.path.join(cfg.out, "loss.png"))
    return row


def train_step(module: KDStudent, stream: SampleStream, optimizer, scheduler, cfg: TrainConfig, state: dict) -> dict:
    """One optimizer step over grad_accum micro-batches, normalised by the step's counted tokens."""
    start = time.perf_counter()
    micro = [stream.batch(state["samples"] + m * cfg.batch_size, cfg.batch_size) for m in range(cfg.grad_accum)]
    tokens = sum(count_tokens(b) for b in micro)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch in micro:
        with _autocast(cfg.autocast_bf16):
            loss = module(batch) / max(tokens, 1)
        loss.backward()
        total += float(loss.detach())
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else math.inf)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    state["step"] += 1
    state["samples"] += cfg.batch_size * cfg.grad_accum
    seconds = time.perf_counter() - start
    return {"step": state["step"], "loss": total, "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": peak_rss_gib()}


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms, biases and other vectors are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def peak_rss_gib() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def plot_losses(metrics_path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path)]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("loss per counted token")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
