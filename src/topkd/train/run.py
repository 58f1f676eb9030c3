"""One training run's state: the `Run` that the train loop (topkd.train.loop) hands down instead of seven objects.

    run = open_run(cfg, device, world)      # student, loss module, optimizer, schedule, data stream
    resumed = run.resume()                  # newest intact checkpoint of cfg.out, if any
    run.save_checkpoint(); save_final(run)

A Run owns what a step reads and changes (module, optimizer, scheduler, stream, the step / samples counters)
and where the run writes (checkpoints, metrics.jsonl, final/), as torchtune's recipes own theirs. The step
loop itself stays in loop.py; this file builds the run and saves it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from topkd.base import dist
from topkd.data.samples import SampleStream, logz_column
from topkd.train import checkpoint as ckpt
from topkd.train.config import TrainConfig, check_paths, loss_options
from topkd.train.lora import save_lora_student
from topkd.train.on_policy import OnPolicy, open_on_policy
from topkd.train.optim import lr_factor, make_optimizer
from topkd.train.parallel import full_state_dict, shard_student
from topkd.train.sources import check_source, check_targets, open_scorer, open_source
from topkd.train.student import KDStudent, Student, load_student


@dataclass
class Run:
    """A training run: its settings, the wrapped student, optimizer and schedule, the data, and the counters
    a checkpoint saves (`state`: optimizer steps taken, samples consumed). student: the loaded model and
    tokenizer that final/ is saved from (None for a run that never saves, as a benchmark's single steps)."""

    cfg: TrainConfig
    module: KDStudent
    stream: SampleStream
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    student: Student | None = None
    world: int = 1
    # counters: optimizer steps, offline samples and on-policy prompts consumed
    state: dict = field(default_factory=lambda: {"step": 0, "samples": 0, "prompts": 0})
    on_policy: OnPolicy | None = None  # --on-policy: its prompts and settings

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.cfg.out, "metrics.jsonl")

    @property
    def samples_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.world

    def save_checkpoint(self) -> str:
        """A collective (every rank calls it); returns the checkpoint's directory."""
        return ckpt.save(self.cfg.out, self.module, self.optimizer, self.scheduler, self.state)

    def resume(self) -> bool:
        """Load the newest intact checkpoint of cfg.out, if any (returns whether one was), and set the learning
        rate to this run's schedule at that step (a resume may extend --steps)."""
        resumed = ckpt.load_latest(
            self.cfg.out, self.module, self.optimizer, self.scheduler, self.state
        )
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lr_factor(self.state["step"], self.cfg)
        return resumed


def open_run(cfg: TrainConfig, device: str, world: int) -> Run:
    """Everything cfg trains, built and placed on device: source, student, loss module (FSDP2-sharded under
    torchrun), AdamW and its schedule. cfg has passed check_config and check_paths."""
    torch.manual_seed(cfg.seed)
    source = open_source(cfg, device)
    check_paths(cfg, teacher_dir=source.teacher_dir if cfg.init_from_teacher else None)
    check_source(cfg, source)
    scorer = open_scorer(cfg, device, source, world) if cfg.on_policy else None
    if scorer is not None and scorer is not source:
        check_targets(cfg, scorer)  # its rows train too
    student = load_student(cfg, source)
    options = loss_options(cfg)
    column = logz_column(source, options.logz_temperature)
    stream = SampleStream(source, cfg.seq_len or source.seq_len, cfg.seed, column, cfg.packing)
    module = KDStudent(
        student.model.to(device),
        source.vocab_size,
        options,
        cfg.activation_checkpointing,
        cfg.objective,
        cfg.top_k,
        torch.bfloat16 if cfg.autocast_bf16 else torch.float32,
        cfg.fold_beyond_vocab,
    )
    shard_student(module, bf16=cfg.autocast_bf16)
    if device.startswith("cuda"):
        # any fp32 GEMM left (a fp32 run's body) on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = True
    optimizer, scheduler = make_optimizer(module, cfg)
    on_policy = None
    if scorer is not None:
        on_policy = open_on_policy(cfg, scorer, logz_column(scorer, options.logz_temperature))
    return Run(cfg, module, stream, optimizer, scheduler, student, world, on_policy=on_policy)


def save_final(run: Run) -> None:
    """save_pretrained of the unsharded student (safetensors) in OUT/final, written by rank 0; a LoRA student's
    adapters (and base, or the merged model) instead (topkd.train.lora)."""
    cfg, student = run.cfg, run.student
    path = os.path.join(cfg.out, "final")
    # one process only (refused under torchrun): the module's weights are the student's
    if cfg.lora_rank:
        save_lora_student(
            student.model, student.tokenizer, path, cfg.merge, base_dir=cfg.student or None
        )
        return
    weights = full_state_dict(run.module)  # a collective; keys carry the wrapper's "model." prefix
    if dist.rank() == 0:
        weights = {name.removeprefix("model."): t for name, t in weights.items()}
        student.model.save_pretrained(path, state_dict=weights)
        student.tokenizer.save_pretrained(path)
    dist.barrier()


def warn_about_schedule(run: Run) -> None:
    """Say so when the run repeats the data or never leaves warmup: both are legal, neither is usually meant."""
    cfg, stream = run.cfg, run.stream
    # the share of steps whose samples the student writes itself
    share = run.on_policy.fraction if run.on_policy else 0.0
    samples = round(cfg.steps * run.samples_per_step * (1 - share))
    if dist.rank() != 0:
        return
    if run.on_policy and cfg.steps * run.samples_per_step * share > len(run.on_policy.prompts):
        _warn(
            f"about {cfg.steps * share:.0f} on-policy steps x {run.samples_per_step} prompts, over "
            f"{len(run.on_policy.prompts)} prompts: the student completes some prompts more than once (fresh "
            "samples each time)"
        )
    if samples > stream.per_epoch:
        _warn(
            f"{cfg.steps} steps x {run.samples_per_step} samples = {samples} samples, "
            f"{samples / stream.per_epoch:.1f} epochs over the {stream.per_epoch} samples of this data; every "
            "sample is seen more than once"
        )
    if cfg.steps < cfg.warmup_steps:
        _warn(
            f"--steps {cfg.steps} is below --warmup-steps {cfg.warmup_steps}: the learning rate never "
            "reaches --lr"
        )
    cached = stream.source.seq_len
    if stream.seq_len > cached and stream.packing != "none":
        _warn(
            f"--seq-len {stream.seq_len} is longer than the cache's {cached}-token sequences: "
            "each sample joins several of them, which the teacher never saw as one context (positions and "
            f"attention restart at each), so no token gets more than {cached} tokens of context; use --seq-len "
            f"{cached} or less, or rebuild the cache with a longer --seq-len"
        )


def _warn(message: str) -> None:
    print(f"topkd train: warning: {message}", file=sys.stderr, flush=True)


def run_title(cfg: TrainConfig) -> str:
    """What a loss curve is of: the run and its objective."""
    run = os.path.basename(os.path.normpath(cfg.out))
    if cfg.objective == "ce":
        return f"{run}: cross entropy only (no teacher)"
    extras = f", ce_weight {cfg.ce_weight:g}" if cfg.ce_weight else ""
    return f"{run}: KD {cfg.divergence}, tail {cfg.tail}, T={cfg.temperature:g}{extras}"
