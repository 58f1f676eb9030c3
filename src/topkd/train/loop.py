"""`topkd train`: train a student against a top-K cache with the fused KD loss.

    topkd train --cache runs/cache --init-from-teacher --layers 6 --out runs/student --steps 500
    torchrun --nproc_per_node 4 -m topkd.cli train ...      # FSDP2: same flags, --batch-size per process

Each optimizer step takes grad_accum micro-batches per process whose summed loss is divided by
the counted tokens of the whole global batch, so accumulation and the number of processes
change nothing but memory and speed (see topkd.train.parallel). AdamW
(no decay on norms and biases), linear warmup then cosine, gradient clipping. Checkpoints
(DCP: model, optimizer, scheduler, samples consumed) are written to a temp directory and
renamed; a rerun of the same command resumes from the newest one and continues the exact loss
trajectory. Outputs in --out: metrics.jsonl, loss.png, final/ (save_pretrained, safetensors).
The functions here take one topkd.train.run.Run: the student, optimizer, schedule, data and counters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict

import torch

from topkd.base import dist
from topkd.base.files import exclusive_lock
from topkd.base.memory import process_peak_bytes, reserved_peak_bytes
from topkd.base.progress import progress
from topkd.base.signals import Interrupted, stop_requests
from topkd.data.samples import SampleStream, count_tokens
from topkd.loss import loss_parts
from topkd.loss.options import LossOptions
from topkd.train import checkpoint as ckpt
from topkd.train.config import TrainConfig, check_config, check_paths, check_resume, teacher_of
from topkd.train.parallel import scalar
from topkd.train.report import open_reporter, plot_losses
from topkd.train.run import Run, open_run, run_title, save_final, warn_about_schedule
from topkd.train.student import KDStudent


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the final metrics row (on every rank)."""
    check_config(cfg)
    check_paths(cfg)
    rank, world = dist.init(cfg.device)
    made = not os.path.isdir(cfg.out)
    os.makedirs(cfg.out, exist_ok=True)
    lock = os.path.join(cfg.out, f".train-{rank}.lock")
    # held from before the student loads: a second run started while the first loads or trains is refused at
    # once, whatever its flags, and never waits to redo a finished run's ending
    with exclusive_lock(
        lock,
        f"{cfg.out}: another topkd train is running there (process {{holder}} holds {{path}}); wait "
        "for it to finish (an overlapping requeued job?), or train into another --out",
    ):
        try:
            run = open_run(cfg, dist.local_device(cfg.device), world)
        except BaseException:
            if made:  # refused before anything ran: --out is left as it was, absent
                shutil.rmtree(cfg.out, ignore_errors=True)
            raise
        return resume_and_run(run)


def resume_and_run(run: Run) -> dict:
    """With --out held: resume from its newest checkpoint, run the remaining steps, save final/ and the plot."""
    cfg, state = run.cfg, run.state
    check_resume(cfg.out, cfg, run.world, resuming=ckpt.latest_step(cfg.out) is not None)
    resumed = run.resume()
    if state["step"] > cfg.steps:
        raise ValueError(
            f"steps: the run in {cfg.out} is already at step {state['step']}, beyond --steps "
            f"{cfg.steps}; pass --steps >= {state['step']} to continue it, or use a new --out"
        )
    warn_about_schedule(run)
    # rows past the checkpoint will be recomputed
    ckpt.truncate_metrics(run.metrics_path, state["step"])
    if dist.rank() == 0:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump({**asdict(cfg), "world_size": run.world}, f, indent=1)
    finished = resumed and state["step"] == cfg.steps  # by an earlier run: nothing to train
    row = (
        run_steps(run, resumed)
        if not finished
        else ckpt.metrics_row(run.metrics_path, state["step"])
    )
    run.save_checkpoint()
    save_final(run)  # again when finished: a run killed while saving it left it incomplete
    if dist.rank() == 0:
        plot_losses(run.metrics_path, os.path.join(cfg.out, "loss.png"), run_title(cfg))
        print(
            f"topkd train: {cfg.out} already holds this run finished at step {state['step']} of --steps "
            f"{cfg.steps}: nothing trained; final/ and loss.png rewritten from its checkpoint (pass a larger "
            "--steps to train on)"
            if finished
            else f"topkd train: wrote {os.path.join(cfg.out, 'final')} (model + tokenizer), metrics.jsonl, "
            f"loss.png and checkpoints/ in {cfg.out} (step {state['step']})",
            flush=True,
        )
    return row


def run_steps(run: Run, resumed: bool) -> dict:
    """The step loop: metrics rows, progress, periodic checkpoints; on SIGINT/SIGTERM a checkpoint, then stop."""
    cfg, state, rank, row = run.cfg, run.state, dist.rank(), {}
    bar = progress(
        total=cfg.steps,
        initial=state["step"],
        desc="train" + (" (resumed)" if resumed else ""),
        unit="step",
        disable=rank != 0,
    )
    # on-policy steps are made from the student of that step: none can be made ahead
    steps = (
        None
        if cfg.on_policy
        else step_loader(run, workers=0 if teacher_of(cfg) else cfg.loader_workers)
    )
    reporter = open_reporter(
        cfg.report_to if rank == 0 else "none", cfg.out, asdict(cfg), state["step"]
    )
    try:
        with stop_requests() as stop, contextlib.closing(reporter):
            while state["step"] < cfg.steps:
                row = train_step(run, micro=None if steps is None else next(steps))
                _record(row, run.metrics_path if rank == 0 else None, reporter, bar)
                signum = int(dist.all_max(float(stop.signum)))  # every rank stops at the same step
                if signum:
                    bar.close()
                    del steps
                    path = run.save_checkpoint()
                    raise Interrupted(
                        signum,
                        f"stopped at step {state['step']}; checkpoint saved to {path}; rerun the same "
                        "command to resume",
                    )
                if (
                    cfg.checkpoint_every
                    and state["step"] % cfg.checkpoint_every == 0
                    and state["step"] < cfg.steps
                ):
                    run.save_checkpoint()
    finally:  # an error mid-run too: the bar's timer stops with it
        bar.close()
    del steps  # loader workers shut down now, not at interpreter exit
    return row


def _record(row: dict, metrics_path: str | None, reporter, bar) -> None:
    """A step's row into metrics.jsonl and the reporter (rank 0: metrics_path given), and onto the bar."""
    if metrics_path is not None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        reporter.log(row)
    # before update: a line printed by it shows this step
    bar.set_postfix(
        loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", GiB=f"{row['peak_gib']:.2f}"
    )
    bar.update(1)


class _StepBatches(torch.utils.data.Dataset):
    """Item i: this rank's micro-batches of the i-th remaining step (a pure function of the sample index)."""

    def __init__(self, stream: SampleStream, cfg: TrainConfig, first_sample: int, steps: int):
        self.stream, self.cfg, self.first_sample, self.steps = stream, cfg, first_sample, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        per_step = self.cfg.batch_size * self.cfg.grad_accum * dist.world()
        return step_batches(self.stream, self.cfg, self.first_sample + i * per_step)


def step_loader(run: Run, workers: int):
    """Micro-batch lists for every remaining step; with workers, decoded ahead in forked processes."""
    cfg, state = run.cfg, run.state
    data = _StepBatches(run.stream, cfg, state["samples"], cfg.steps - state["step"])
    if workers == 0:
        return (data[i] for i in range(len(data)))
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=2,
        multiprocessing_context="fork",
        worker_init_fn=_ignore_interrupts,
    )
    return iter(loader)


def _ignore_interrupts(worker_id: int) -> None:
    """Ctrl-C reaches the whole process group: workers leave it to the trainer, which checkpoints first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def step_batches(
    stream: SampleStream, cfg: TrainConfig, first_sample: int
) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the step starting at first_sample. Micro-batch m of rank r holds
    samples (m * world + r) * batch_size onwards, so N ranks with --batch-size b see exactly the
    samples one process with --batch-size N*b would."""
    world, rank, size = dist.world(), dist.rank(), cfg.batch_size
    return [
        stream.batch(first_sample + (m * world + rank) * size, size) for m in range(cfg.grad_accum)
    ]


def train_step(run: Run, micro: list[dict] | None = None) -> dict:
    """One optimizer step: grad_accum micro-batches per rank, normalised by the global batch's counted tokens.
    micro: the step's batches when already loaded (step_loader); otherwise read from the stream here."""
    start = time.perf_counter()
    cfg, state, module, optimizer = run.cfg, run.state, run.module, run.optimizer
    world, rank = dist.world(), dist.rank()
    # dropout etc.: resume needs no RNG state
    torch.manual_seed(cfg.seed * 1_000_003 + state["step"] * world + rank)
    device = next(module.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # peak_gib is this step's
    micro, made = (micro, {}) if micro else step_inputs(run)
    micro = [_to(b, device) for b in micro]
    tokens = dist.all_sum(sum(count_tokens(b) for b in micro))
    optimizer.zero_grad(set_to_none=True)
    monitor = (
        teacher_rkl_options(module.options) if made and cfg.divergence != "reverse_kl" else None
    )
    total, kd_sum, ce_sum, monitored = _backward(module, micro, cfg, device, tokens, monitor)
    params = [p for p in module.parameters() if p.grad is not None]
    clip = cfg.clip if cfg.clip > 0 else math.inf
    grad_norm = scalar(torch.nn.utils.clip_grad_norm_(params, clip))
    lr, loss = optimizer.param_groups[0]["lr"], dist.all_sum(total)
    finite = _update(optimizer, cfg, state["step"] + 1, loss, grad_norm, tokens)
    run.scheduler.step()
    epoch = state["samples"] // run.stream.per_epoch
    state["step"] += 1
    state["prompts" if made else "samples"] += cfg.batch_size * cfg.grad_accum * world
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the optimizer step's kernels are part of the step's time
    seconds = time.perf_counter() - start
    parts = {"kd_loss": dist.all_sum(kd_sum) / max(tokens, 1)} if cfg.objective == "kd" else {}
    if cfg.objective == "kd" and cfg.ce_weight:
        parts["ce_loss"] = dist.all_sum(ce_sum) / max(tokens, 1)
    return {
        "step": state["step"],
        "epoch": epoch,
        "loss": loss,
        **parts,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_gib": dist.all_max(process_peak_bytes(device) / 2**30),
        **_reserved_gib(device),
        **({} if finite else {"skipped": True}),
        **_on_policy_metrics(made, seconds),
        # on-policy under another divergence: what the recipe optimises, measured on the same rows and states
        **({"teacher_rkl": monitored / max(tokens, 1)} if monitor is not None else {}),
    }


def step_inputs(run: Run) -> tuple[list[dict], dict]:
    """This rank's micro-batches of the step, read from the stream, or (an on-policy step) written by the
    student and scored by the teacher; and for the latter what making them took ({} for the former)."""
    cfg, state = run.cfg, run.state
    if run.on_policy is None or not run.on_policy.chooses(state["step"]):
        return step_batches(run.stream, cfg, state["samples"]), {}
    model = run.module.model
    world, rank = dist.world(), dist.rank()
    return run.on_policy.step_batches(
        model, state["prompts"], state["step"], cfg.grad_accum, cfg.batch_size, world, rank
    )


def _on_policy_metrics(made: dict, seconds: float) -> dict:
    """An on-policy step's row: generation and scoring apart from the update, what the student wrote, and the
    loss on its own samples (the teacher's reverse KL there, with --divergence reverse_kl)."""
    if not made:
        return {}
    return {
        "on_policy": True,
        "generate_s": made["generate_s"],
        "score_s": made["score_s"],
        "update_s": seconds - made["generate_s"] - made["score_s"],
        "generated_tokens": made["generated_tokens"],
        "completion_len": made["generated_tokens"] / max(made["completions"], 1),
        # completions a served teacher read as other tokens (it re-tokenised their text): left out of the loss
        **({"unscored": made["unscored"]} if made.get("unscored") else {}),
    }


def _backward(
    module: KDStudent, micro: list[dict], cfg: TrainConfig, device, tokens: int, monitor=None
):
    """Forward and backward of each micro-batch, gradients accumulating; the loss, its KD and CE sums, and the
    summed monitor loss (0.0 without monitor)."""
    total, kd_sum, ce_sum, monitored = 0.0, 0.0, 0.0, 0.0
    for batch in micro:
        with _autocast(cfg.autocast_bf16, device), loss_parts() as parts:
            loss = module(batch, monitor) / max(tokens, 1)
        loss.backward()
        total += float(loss.detach())
        kd_sum += float(parts["kd"])  # loss.detach() synced already: these cost no wait
        ce_sum += float(parts["ce"])
        monitored += float(module.monitored) if monitor is not None else 0.0
    return total, kd_sum, ce_sum, monitored


def teacher_rkl_options(options: LossOptions) -> LossOptions:
    """The teacher's reverse KL per token at T = 1 over the rows the run trains on (its tail as the run's), the
    quantity on-policy distillation optimises: logged on on-policy steps of a run whose loss is another."""
    return dataclasses.replace(options, divergence="reverse_kl", temperature=1.0, ce_weight=0.0)


def _update(
    optimizer, cfg: TrainConfig, step: int, loss: float, grad_norm: float, tokens: int
) -> bool:
    """Apply the step's update if it has counted tokens and finite numbers; a non-finite one stops the run
    (unless --skip-nonfinite). Returns whether the numbers were finite."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    # loss and gradient 0: an update would only apply decay and stale momentum
    if not tokens and dist.rank() == 0:
        print(
            f"topkd train: warning: step {step}: its samples hold no counted token (chat prompts "
            "only); skipped, the weights were not updated",
            file=sys.stderr,
            flush=True,
        )
    if finite and tokens:
        optimizer.step()
    elif not finite and not cfg.skip_nonfinite:  # never apply, let alone checkpoint, NaN weights
        last = ckpt.latest_step(cfg.out)
        raise ValueError(
            f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite; the "
            "weights were not updated and the newest checkpoint "
            f"({'none' if last is None else f'step {last}'}) is intact; lower --lr, check the data, or "
            "pass --skip-nonfinite to skip such steps"
        )
    return finite


def _reserved_gib(device: torch.device) -> dict:
    reserved = reserved_peak_bytes(device)
    return {} if reserved is None else {"peak_reserved_gib": dist.all_max(reserved / 2**30)}


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return (
        batch
        if device.type == "cpu"
        else {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    )


def _autocast(enabled: bool, device: torch.device):
    return (
        torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()
    )
