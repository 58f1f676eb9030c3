"""Helpers the training tests share: a small run's config and CLI line, its logged losses."""

import json
import os
import sys
import time

from topkd.train import TrainConfig


def config(cache, out, **kw):
    opts = dict(
        cache=cache,
        out=str(out),
        init_from_teacher=True,
        layers=1,
        steps=4,
        batch_size=2,
        grad_accum=1,
        lr=3e-3,
        warmup_steps=1,
        checkpoint_every=0,
        seed=0,
    )
    opts.update(kw)
    return TrainConfig(**opts)


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def cli_args(cache, out, steps):
    return [
        sys.executable,
        "-m",
        "topkd.cli",
        "train",
        "--cache",
        cache,
        "--out",
        str(out),
        "--init-from-teacher",
        "--layers",
        "1",
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--seq-len",
        "24",
    ]


def wait_for_rows(path, n, proc, timeout=120):
    """Until metrics.jsonl at path holds n rows (or proc ended, or timeout seconds passed)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and sum(1 for _ in open(path)) >= n:
            return
        time.sleep(0.01)
