"""Small-scale experiments on SmolLM2 + Shakespeare: online vs offline, impls, tail x K, divergences, packing.

    python benchmarks/experiments.py --demo runs/demo --which fourway,tail_k,divergence,packing \
        --out benchmarks/results/experiments

Reuses what `topkd demo` built in --demo (teacher directory, top-100 cache of the plays, held-out
Hamlet cache, the untrained 4-layer student). Every run is a fresh `topkd train` process from
the same student, data, seed and steps (so its peak memory is its own), then scored on held-out
Hamlet: KL(teacher || student) (bucket, and renormalised on the top-K), top-1 agreement, bits
per byte. The packing experiment trains on short documents instead (every speech of the training
plays is one JSONL document, in a seeded order; its own top-100 cache) and is scored on Hamlet's
speeches. Writes experiments.json (rerunning one experiment keeps the others), report.txt and one
loss-curve plot per experiment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys

from topkd.bench import stamp
from topkd.demo.run import split_texts
from topkd.eval import EvalConfig, run_eval

EXPERIMENTS = {
    "fourway": {
        "online-full": ["--online-k", "0"],
        "offline-dense": ["--impl", "dense"],
        "offline-chunked": ["--impl", "chunked"],
        "offline-fused": ["--impl", "fused"],
    },
    "tail_k": {
        f"k{k}-{tail}": ["--top-k", str(k), "--tail", tail]
        for k in (1, 8, 32, 100)
        for tail in ("bucket", "renorm")
    },
    "divergence": {d: ["--divergence", d] for d in ("kl", "reverse_kl", "jsd", "tvd")},
    "packing": {
        "packed-doc-mask": ["--packing", "documents"],
        "packed-cross-doc": ["--packing", "cross"],
        "unpacked": ["--packing", "none"],
        "unpacked-same-tokens": ["--packing", "none"],
        "unpacked-same-tokens-steps": ["--packing", "none"],
    },
}


def train_run(args, name: str, flags: list[str], cache: str = "") -> str:
    out = os.path.join(args.out, "runs", name)
    if os.path.exists(os.path.join(out, "final", "config.json")):
        return out
    plays, _ = split_texts(plays_dir(args))
    data = (
        [
            "--teacher",
            os.path.join(args.demo, "teacher"),
            "--data",
            *plays,
            "--max-sequences",
            str(args.sequences),
            "--seq-len",
            str(args.seq_len),
        ]
        if "--online-k" in flags
        else ["--cache", cache or os.path.join(args.demo, "cache")]
    )
    cmd = [
        sys.executable,
        "-m",
        "topkd.cli",
        "train",
        *data,
        "--student",
        os.path.join(args.demo, "student-init"),
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
        *flags,
    ]
    print("==", name, " ".join(flags), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out


def score(args, name: str, run_dir: str, heldout: tuple[str, str] | None = None) -> dict:
    """Held-out scores of a finished run; heldout = (text file, its cache), by default the demo's Hamlet."""
    path = os.path.join(run_dir, "eval.json")
    if not os.path.exists(path):
        text, cache = heldout or (
            split_texts(plays_dir(args))[1],
            os.path.join(args.demo, "heldout-cache"),
        )
        run_eval(
            EvalConfig(
                model=os.path.join(run_dir, "final"),
                name=name,
                text=[text],
                seq_len=args.seq_len,
                max_tokens=args.heldout_tokens,
                cache=cache,
                out=path,
            )
        )
    result = json.load(open(path))["result"]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    params = _params(os.path.join(run_dir, "final"))
    step_s = statistics.median(r["seconds"] for r in rows[1:] or rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    return {
        "name": name,
        "steps": len(rows),
        "tokens_per_s": sum(r["tokens"] for r in rows[1:])
        / max(sum(r["seconds"] for r in rows[1:]), 1e-9),
        "train_tokens": sum(r["tokens"] for r in rows),
        "kl_bucket": result["vs_teacher"]["kl_bucket"],
        "kl_renorm": result["vs_teacher"]["kl_renorm"],
        "top1": result["vs_teacher"]["top1_agreement"],
        "bits_per_byte": result["text"]["bits_per_byte"],
        "peak_gib": max(r["peak_gib"] for r in rows),
        "step_s": step_s,
        "gflops": 6 * params * tokens / step_s / 1e9,
        "final_loss": rows[-1]["loss"],
        "curve": [r["loss"] for r in rows],
        "curve_tokens": list(itertools.accumulate(r["tokens"] for r in rows)),
    }


def speeches(paths: list[str], out: str, seed: int = 0) -> str:
    """Every speech (blank-line separated block) of the plays as one JSONL document, in a seeded order."""
    if not os.path.exists(out):
        docs = [
            block.strip()
            for path in paths
            for block in open(path, encoding="utf-8").read().split("\n\n")
            if block.strip()
        ]
        random.Random(seed).shuffle(docs)
        with open(out + ".tmp", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        os.replace(out + ".tmp", out)
    return out


def packing_runs(args) -> list[dict]:
    """Packed with document masking, packed attending across documents, one document per sample (same steps and
    batch; as many steps as it takes to see the packed run's tokens; the same steps with a batch as many times
    larger): same student, speeches, top-100 cache."""
    from topkd.cache import CacheBuildConfig, build

    work = os.path.join(args.out, "runs", "packing-data")
    os.makedirs(work, exist_ok=True)
    plays, hamlet = split_texts(plays_dir(args))
    data = {
        "train": speeches(plays, os.path.join(work, "speeches.jsonl")),
        "heldout": speeches([hamlet], os.path.join(work, "hamlet-speeches.jsonl")),
    }
    caches = {}
    for part, seqs in (("train", args.sequences), ("heldout", args.heldout_tokens // args.seq_len)):
        caches[part] = os.path.join(work, f"{part}-cache")
        build(
            CacheBuildConfig(
                teacher=os.path.join(args.demo, "teacher"),
                data=[data[part]],
                out=caches[part],
                seq_len=args.seq_len,
                targets="topk",
                k=100,
                max_sequences=seqs,
            )
        )
    rows, flags = [], EXPERIMENTS["packing"]
    for name in ("packed-doc-mask", "packed-cross-doc", "unpacked"):
        run = train_run(args, "packing-" + name, flags[name], cache=caches["train"])
        rows.append(
            {**score(args, name, run, (data["heldout"], caches["heldout"])), "flags": flags[name]}
        )
    ratio = rows[0]["train_tokens"] / rows[2]["train_tokens"]
    for name, extra in (
        ("unpacked-same-tokens", ["--steps", str(round(args.steps * ratio))]),
        ("unpacked-same-tokens-steps", ["--batch-size", str(round(4 * ratio))]),
    ):
        run = train_run(args, "packing-" + name, flags[name] + extra, cache=caches["train"])
        rows.append(
            {
                **score(args, name, run, (data["heldout"], caches["heldout"])),
                "flags": flags[name] + extra,
            }
        )
    return rows


def packing_table(rows: list[dict]) -> str:
    head = f"{'run':<28}{'steps':>6}{'tokens':>9}{'tok/s':>8}{'KL bucket':>10}{'top-1':>7}{'bits/B':>8}{'step s':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<28}{r['steps']:>6}{r['train_tokens']:>9}{r['tokens_per_s']:>8.0f}"
            f"{r['kl_bucket']:>10.4f}{r['top1']:>7.3f}{r['bits_per_byte']:>8.4f}{r['step_s']:>8.2f}"
        )
    return "\n".join(lines)


def _params(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        # tied head
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys() if k != "lm_head.weight")


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def table(rows: list[dict]) -> str:
    head = (
        f"{'run':<18}{'KL bucket':>10}{'KL renorm':>10}{'top-1':>7}{'bits/B':>8}{'peak GiB':>9}{'step s':>8}"
        f"{'GFLOP/s':>8}{'loss':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<18}{r['kl_bucket']:>10.4f}{r['kl_renorm']:>10.4f}{r['top1']:>7.3f}"
            f"{r['bits_per_byte']:>8.4f}{r['peak_gib']:>9.2f}{r['step_s']:>8.2f}{r['gflops']:>8.1f}"
            f"{r['final_loss']:>8.4f}"
        )
    return "\n".join(lines)


def fourway_claims(rows: list[dict]) -> list[str]:
    by = {r["name"]: r for r in rows}
    online, fused = by["online-full"], by["offline-fused"]
    gap = abs(fused["kl_bucket"] - online["kl_bucket"]) / online["kl_bucket"]
    offline = [by[n] for n in ("offline-dense", "offline-chunked", "offline-fused")]
    return [
        f"{'PASS' if gap <= 0.02 else 'FAIL'}  offline top-100 held-out KL within 2% of online: {gap:.2%}",
        f"{'PASS' if fused['peak_gib'] == min(r['peak_gib'] for r in offline) else 'FAIL'}  fused has the "
        f"lowest peak memory of the offline impls ({fused['peak_gib']:.2f} GiB)",
        f"{'PASS' if fused['step_s'] < max(r['step_s'] for r in offline) else 'FAIL'}  fused is not the slowest "
        f"offline impl ({fused['step_s']:.2f} s/step)",
    ]


def plot(rows: list[dict], title: str, path: str, by_tokens: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        x = r["curve_tokens"] if by_tokens else range(1, len(r["curve"]) + 1)
        ax.plot(x, r["curve"], label=f"{r['name']} (KL {r['kl_bucket']:.3f})", lw=1.0)
    ax.set_xlabel("training tokens (counted)" if by_tokens else "step")
    ax.set_ylabel("training loss per counted token")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def standard_runs(args, which: str) -> list[dict]:
    # the same run under another name
    shared = {"kl": "offline-fused", "k100-bucket": "offline-fused"}
    rows = []
    for name, flags in EXPERIMENTS[which].items():
        run = train_run(
            args,
            shared.get(name, name),
            flags if name not in shared else EXPERIMENTS["fourway"]["offline-fused"],
        )
        rows.append({**score(args, name, run), "flags": flags})
    return rows


def plays_dir(args) -> str:
    """The plays the demo in --demo was built from (its report.json), unless --texts names others."""
    if args.texts:
        return args.texts
    with open(os.path.join(args.demo, "report.json")) as f:
        return json.load(f)["config"]["texts"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", default="runs/demo", help="a finished `topkd demo` directory")
    p.add_argument("--which", default="fourway,tail_k,divergence,packing")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite report.txt from experiments.json, run nothing",
    )
    p.add_argument("--out", default="benchmarks/results/experiments")
    p.add_argument(
        "--texts", default="", help="the plays directory (default: the one --demo was built from)"
    )
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--sequences", type=int, default=256, help="the demo cache's sequence count (online runs)"
    )
    p.add_argument("--heldout-tokens", type=int, default=8192)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "experiments.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    for which in [] if args.report_only else args.which.split(","):
        if which not in EXPERIMENTS:
            raise SystemExit(f"--which: expected names from {sorted(EXPERIMENTS)}, got {which!r}")
        results[which] = packing_runs(args) if which == "packing" else standard_runs(args, which)
        results.setdefault("stamps", {})[which] = {"stamp": stamp("cpu"), "args": vars(args)}
        plot(
            results[which],
            f"{which}: SmolLM2-135M -> 4 layers, Shakespeare",
            os.path.join(args.out, f"{which}.png"),
            by_tokens=which == "packing",
        )
    text = report(results)
    print(text)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(text)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def report(results: dict) -> str:
    """report.txt from experiments.json: one stamped table per experiment."""
    lines = []
    for which in [w for w in EXPERIMENTS if w in results]:
        s, rows = results["stamps"][which]["stamp"], results[which]
        lines += [
            f"## {which}  ({s['machine']}, torch {s['torch']}, commit {s['commit']}, {s['date']})",
            packing_table(rows) if which == "packing" else table(rows),
        ]
        lines += (
            fourway_claims(rows)
            if which == "fourway"
            else packing_summary(rows)
            if which == "packing"
            else []
        ) + [""]
    return "\n".join(lines)


def packing_summary(rows: list[dict]) -> list[str]:
    by = {r["name"]: r for r in rows}
    packed, cross, same = (
        by["packed-doc-mask"],
        by["packed-cross-doc"],
        by["unpacked-same-tokens-steps"],
    )
    return [
        f"equal tokens and steps: packed+doc-mask KL {packed['kl_bucket']:.4f} vs unpacked "
        f"{same['kl_bucket']:.4f} ({same['kl_bucket'] / packed['kl_bucket'] - 1:+.1%}), tokens/s "
        f"{packed['tokens_per_s'] / same['tokens_per_s']:.2f}x",
        f"attending across documents: KL {cross['kl_bucket'] / packed['kl_bucket'] - 1:+.1%}, tokens/s "
        f"{cross['tokens_per_s'] / packed['tokens_per_s']:.2f}x of doc-mask",
    ]


if __name__ == "__main__":
    main()
