"""Helpers the training tests share: a small run's config and CLI line, its logged losses."""

import json
import os
import sys

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
