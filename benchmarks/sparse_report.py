"""The sparse-targets experiment's report: per-arm summary, the verdict against dense KD, and the tokens scaling.

Pure functions over the stored per-run scores (benchmarks/sparse_targets.py writes them); no model is loaded, so
`python -m benchmarks.sparse_targets --render --out DIR` redoes report.txt and sparse.png from sparse.json alone.
A run's score is a dict of METRICS; `runs` maps arm -> seed -> score.
"""

from __future__ import annotations

import json
import os
import statistics

METRICS = ("lm_loss", "bits_per_byte", "kl_full", "ece", "acceptance")
CEILING = "dense online"


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def summarise(runs: dict, sizes: dict) -> dict:
    """Per arm: the mean and seed-to-seed spread (max - min) of each metric, its cache's bytes/token and build
    time (sizes: arm -> {bytes_per_token, build_s} or None for online arms), and the share of the CE -> dense gap
    it closes (from the means) in held-out LM loss (gap_closed) and in full-vocabulary KL (kl_gap_closed); None
    where CE is no worse than dense KD on that measure (no gap to close: on chat, CE can win in LM loss)."""
    arms = {}
    for name, by_seed in runs.items():
        scores = list(by_seed.values())
        row = {m: statistics.fmean(r[m] for r in scores) for m in METRICS}
        row.update({f"{m}_spread": _spread([r[m] for r in scores]) for m in METRICS})
        size = sizes.get(name) or {}
        row.update(
            seeds=sorted(by_seed, key=int),
            bytes_per_token=size.get("bytes_per_token"),
            build_s=size.get("build_s"),
        )
        arms[name] = row
    ce, dense = arms.get("ce"), arms.get(CEILING)
    for row in arms.values():
        row["gap_closed"] = _share_closed(ce, dense, row, "lm_loss")
        row["kl_gap_closed"] = _share_closed(ce, dense, row, "kl_full")
    return arms


def _share_closed(ce: dict | None, dense: dict | None, row: dict, metric: str) -> float | None:
    if not (ce and dense and ce[metric] > dense[metric]):
        return None
    return (ce[metric] - row[metric]) / (ce[metric] - dense[metric])


def table(arms: dict) -> str:
    head = (
        f"{'arm':<24}{'seeds':>6}{'B/token':>8}{'build s':>8}{'LM loss':>9}{'+-':>7}{'bits/B':>8}"
        f"{'KL full':>9}{'+-':>7}{'ECE':>7}{'accept':>8}{'LM gap%':>8}{'KL gap%':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, r in arms.items():
        size = "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token']:.1f}"
        built = "-" if r["build_s"] is None else f"{r['build_s']:.0f}"
        gap, kl_gap = (
            "-" if r.get(key) is None else f"{100 * r[key]:.0f}"
            for key in ("gap_closed", "kl_gap_closed")
        )
        lines.append(
            f"{name:<24}{len(r['seeds']):>6}{size:>8}{built:>8}{r['lm_loss']:>9.4f}{r['lm_loss_spread']:>7.4f}"
            f"{r['bits_per_byte']:>8.4f}{r['kl_full']:>9.4f}{r['kl_full_spread']:>7.4f}{r['ece']:>7.4f}"
            f"{r['acceptance']:>8.4f}{gap:>8}{kl_gap:>8}"
        )
    return "\n".join(lines)


def paired(runs: dict, name: str, metric: str, ceiling: str = CEILING) -> dict[str, float]:
    """Seed -> the arm's metric minus the ceiling's, over the seeds both have (the same data order)."""
    arm, top = runs[name], runs[ceiling]
    return {s: arm[s][metric] - top[s][metric] for s in sorted(set(arm) & set(top), key=int)}


def _versus(runs: dict, name: str, metric: str) -> str:
    """One metric of an arm against the ceiling: the mean of the paired per-seed differences (seeds both have,
    so an arm still missing a seed is not compared with the ceiling's other seeds), those differences, and
    whether the mean lies within the larger of the two arms' seed spreads."""
    arm, top = runs[name], runs[CEILING]
    pairs = paired(runs, name, metric)
    mean = statistics.fmean(pairs.values())
    spread = max(_spread([r[metric] for r in rs.values()]) for rs in (arm, top))
    per_seed = ", ".join(f"{d:+.4f}" for d in pairs.values())
    within = "within" if abs(mean) <= spread else f"outside by {abs(mean) - spread:.4f}"
    return f"{metric} {mean:+.4f} (per seed {per_seed}; spread {spread:.4f}: {within})"


def verdict(runs: dict, arms: dict, reference: str = "top-100 bucket") -> str:
    """For every sparse arm, computed: does it reach the dense-KD student within the seed spread (held-out LM
    loss, full-vocabulary KL), is its ECE no worse, and at what share of top-100's bytes."""
    if CEILING not in runs:
        return f"(no '{CEILING}' arm yet: nothing to compare against)"
    lines = [
        f"each arm against '{CEILING}': mean difference, paired per-seed differences, seed spread"
    ]
    for name in runs:
        if name in (CEILING, "ce"):
            continue
        row, top = arms[name], arms[CEILING]
        ece = "no worse" if row["ece"] <= top["ece"] else f"worse by {row['ece'] - top['ece']:.4f}"
        size = (
            ""
            if reference not in arms or row["bytes_per_token"] is None
            else f"; bytes {row['bytes_per_token'] / arms[reference]['bytes_per_token']:.2f}x top-100's"
        )
        lines += [f"  {name}:"] + [f"    {_versus(runs, name, m)}" for m in ("lm_loss", "kl_full")]
        lines.append(f"    ECE {row['ece']:.4f} vs {top['ece']:.4f} ({ece}){size}")
    return "\n".join(lines)


def scaling(result: dict, baseline: dict) -> str:
    """Each arm's gap to dense KD in full-vocabulary KL here against the same arm in a baseline run with fewer
    training tokens: the mean paired gap and its spread over seeds at both, and whether it shrank by more than
    the larger spread (the claim that sampled targets' noise averages out with more tokens)."""
    here, there = result["runs"], baseline["runs"]
    tokens = {r: _train_tokens(x) for r, x in (("here", here), ("there", there))}
    lines = [
        f"gap to '{CEILING}' in full-vocabulary KL, {tokens['there']:,} -> {tokens['here']:,} training tokens "
        f"per run (baseline {baseline.get('source', '?')}): mean paired gap [per-seed spread]"
    ]
    for name in here:
        if name == CEILING or name not in there or CEILING not in here or CEILING not in there:
            continue
        now, before = paired(here, name, "kl_full"), paired(there, name, "kl_full")
        if not now or not before:
            continue
        change = statistics.fmean(now.values()) - statistics.fmean(before.values())
        noise = max(_spread(list(now.values())), _spread(list(before.values())))
        call = "shrank" if change < -noise else "grew" if change > noise else "no change beyond"
        lines.append(
            f"  {name:<24}{statistics.fmean(before.values()):+.4f} [{_spread(list(before.values())):.4f}] -> "
            f"{statistics.fmean(now.values()):+.4f} [{_spread(list(now.values())):.4f}]  "
            f"{change:+.4f}: {call} the spread {noise:.4f}"
        )
    return "\n".join(lines)


def _train_tokens(runs: dict) -> int:
    return max(score["train_tokens"] for by_seed in runs.values() for score in by_seed.values())


def plot(arms: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(arms) + 2))
    for ax, metric, label in (
        (axes[0], "lm_loss", "held-out LM loss (nats/token)"),
        (axes[1], "kl_full", "full-vocabulary KL(teacher || student)"),
    ):
        names = list(arms)
        values = [arms[n][metric] for n in names]
        spread = [arms[n][f"{metric}_spread"] / 2 for n in names]
        bars = ax.barh(names, values, xerr=spread, color="tab:blue", alpha=0.7)
        ax.bar_label(bars, labels=[f"{v:.3f}" for v in values], padding=14, fontsize=8)
        ax.set_xlim(min(values) * 0.97, max(values) * 1.03)
        ax.set_xlabel(label + "; whiskers: seed spread")
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def held(args: dict) -> str:
    if args.get("chat"):
        return f"conversations from Hamlet (their first {args['heldout_tokens']} tokens, assistant tokens scored)"
    return f"Hamlet ({args['heldout_tokens']} tokens)"


def write(result: dict, out: str, baseline: dict | None = None) -> str:
    """sparse.json, report.txt (table, verdict, scaling against a baseline) and sparse.png in out, from one result."""
    args, arms = result["args"], result["arms"]
    data = f"chat set ({args['chat']} conversations)" if args.get("chat") else "the plays"
    text = "\n".join(
        [
            f"sparse targets on {data}: {args['steps']} steps x 4 x {args['seq_len']} tokens per arm, seeds "
            f"{args['seeds']}, held-out {held(args)} vs the live teacher",
            "stamp: "
            + " ".join(
                f"{k}={v}" for k, v in result["stamp"].items() if isinstance(v, (str, int, float))
            ),
            "+-: seed-to-seed spread (max - min); LM gap% / KL gap%: share of the CE -> dense-KD gap closed in "
            "held-out LM loss / full-vocabulary KL ('-': CE is no worse than dense KD there, no gap to close)",
            table(arms),
            "",
            verdict(result["runs"], arms),
            *(["", scaling(result, baseline)] if baseline else []),
        ]
    )
    with open(os.path.join(out, "sparse.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text + "\n")
    title = f"sparse teacher targets: SmolLM2-135M -> 4 layers, {data}, held-out Hamlet, {args['steps']} steps"
    plot(arms, os.path.join(out, "sparse.png"), title)
    return text
