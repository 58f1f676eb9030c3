"""Where an on-policy step's time goes, and whether the training loop adds any of its own (issue 35, item 6).

    python -m benchmarks.on_policy_speed --teacher TEACHER --data chats.jsonl \
        --out benchmarks/results/on-policy-speed-cpu/speed.json [--steps 6 --batch-size 4 --max-new-tokens 64]

Two runs of the same settings from the same init (--init-from-teacher --layers 4, the in-process teacher's top
--online-k), stepped in turn so that both see the same machine load: A takes its steps through the training loop
(topkd.train.loop.train_step), B makes the same steps by hand, one phase at a time: the student generates, the
teacher's forward gives its rows, the update (the batch made, forward, backward, clip, AdamW). Both follow the
same trajectory (the same seeds), so their tokens match. The report gives each phase's tokens/s (generated;
scored = prompt + completion; read by the update, and trained: the completion's), the share of a step the update
takes, and the check the issue asks for: A's step time over the sum of B's phases, at most 1.3 (no hidden
re-tokenising or copies). The first step of each (lazy initialisation) is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import numpy as np
import torch

from topkd.bench import (
    Sequence,
    completion_item,
    generate,
    open_run,
    stamp,
    train_step,
    write_json_atomic,
)
from topkd.data import collate
from topkd.train import TrainConfig

LIMIT = 1.3


def one_by_one(run, step: int) -> dict:
    """Step `step` of run made phase by phase, each timed alone; the update as train_step applies it."""
    cfg, policy, module = run.cfg, run.on_policy, run.module
    torch.manual_seed(cfg.seed * 1_000_003 + step)  # as train_step seeds it
    first = step * cfg.batch_size
    prompts = [policy.prompt(i) for i in range(first, first + cfg.batch_size)]
    start = time.perf_counter()
    stop, pad = policy.stop_ids, policy.pad_id
    completions = generate(
        module.model, prompts, policy.settings, policy._seed(step, 0, 0), stop, pad
    )
    generated = time.perf_counter()
    tokens = [np.concatenate([p, c]) for p, c in zip(prompts, completions)]
    seqs = [Sequence(t, np.zeros(1, np.int64), i, 0) for i, t in enumerate(tokens)]
    rows = policy.teacher.rows(seqs)
    scored = time.perf_counter()
    items = [completion_item(t, len(p), r, None) for t, p, r in zip(tokens, prompts, rows)]
    for item in items:
        item.pop("scored")
    batch = collate(items)
    counted = int(batch["kd_mask"].sum())
    run.optimizer.zero_grad(set_to_none=True)
    loss = module(batch) / counted
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.grad is not None], cfg.clip)
    run.optimizer.step()
    run.scheduler.step()
    done = time.perf_counter()
    return {
        "generate_s": generated - start,
        "score_s": scored - generated,
        "update_s": done - scored,
        "generated_tokens": sum(len(c) for c in completions),
        "scored_tokens": sum(len(t) for t in tokens),
        "trained_tokens": counted,
        "loss": float(loss.detach()),
    }


def config(args, out: str) -> TrainConfig:
    return TrainConfig(
        teacher=args.teacher,
        data=[args.data],
        on_policy=True,
        init_from_teacher=True,
        layers=args.layers,
        online_k=100,
        divergence="reverse_kl",
        max_new_tokens=args.max_new_tokens,
        seq_len=256,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=5e-4,
        warmup_steps=1,
        checkpoint_every=0,
        out=out,
    )


def summary(loop: list[dict], phases: list[dict]) -> dict:
    def total(rows, key):
        return sum(r[key] for r in rows)

    by_hand = total(phases, "generate_s") + total(phases, "score_s") + total(phases, "update_s")
    step_s = total(loop, "seconds")
    return {
        "steps_timed": len(loop),
        "loop_step_s": step_s / len(loop),
        "one_by_one_step_s": by_hand / len(phases),
        "ratio": step_s / by_hand,
        "limit": LIMIT,
        "update_share": total(loop, "update_s") / step_s,
        "tokens_per_s": {
            "generate": total(phases, "generated_tokens") / total(phases, "generate_s"),
            "score": total(phases, "scored_tokens") / total(phases, "score_s"),
            "update": total(phases, "scored_tokens")
            / total(phases, "update_s"),  # the tokens it reads
            "trained": total(phases, "trained_tokens")
            / total(phases, "update_s"),  # the completions
        },
        "loop_split_s": {
            k: total(loop, k) / len(loop) for k in ("generate_s", "score_s", "update_s")
        },
        # the same work: both made the same completions and took the same loss
        "same_tokens": [r["generated_tokens"] for r in loop]
        == [p["generated_tokens"] for p in phases],
        "loss_gap_max": max(abs(r["loss"] - p["loss"]) for r, p in zip(loop, phases)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--data", required=True, help="chat JSONL: the prompts")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--layers", type=int, default=4, help="the student: this many of the teacher's layers"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        loop_run = open_run(config(args, os.path.join(work, "a")), "cpu", 1)
        hand_run = open_run(config(args, os.path.join(work, "b")), "cpu", 1)
        loop, phases = [], []
        for step in range(args.steps):
            loop.append(train_step(loop_run))
            phases.append(one_by_one(hand_run, step))
            by_hand = sum(phases[-1][k] for k in ("generate_s", "score_s", "update_s"))
            print(
                f"step {step}: loop {loop[-1]['seconds']:.2f} s, one by one {by_hand:.2f} s",
                flush=True,
            )
    result = {
        "bench": "on-policy-speed",
        "stamp": stamp("cpu"),
        "args": vars(args),
        **summary(loop[1:], phases[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "stamp"}, indent=1))
    verdict = "within" if result["ratio"] <= LIMIT and math.isfinite(result["ratio"]) else "OVER"
    print(
        f"on-policy step through the loop / phases one by one: {result['ratio']:.3f} ({verdict} the {LIMIT}x limit)"
    )


if __name__ == "__main__":
    main()
