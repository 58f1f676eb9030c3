"""The demo's report: report.txt (what a reader wants first), report.json (everything), demo.png (curves, bars).

demo.png, left to right: the training curves; held-out bits per byte and full-vocabulary KL to the teacher of the
trained students side by side (KD on top-K targets, KD on sampled targets, CE), each bar carrying its value, the
teacher as a dashed line, the untrained student in a note (its figures are off that scale); then the chat step.
"""

from __future__ import annotations

import json
import os

from topkd.base.progress import wrote
from topkd.demo.chat import chat_lines

MODELS = ("teacher", "student-init", "student-kd", "student-sampled", "student-ce")
TRAINED = ("student-kd", "student-sampled", "student-ce")
COLORS = {"student-kd": "tab:blue", "student-sampled": "tab:green", "student-ce": "tab:gray"}


def labels(report: dict) -> dict[str, str]:
    cfg = report["config"]
    return {
        "teacher": "teacher",
        "student-init": "untrained",
        "student-kd": f"KD top-{cfg['k']}",
        "student-sampled": f"KD sampled N={cfg.get('samples')}",
        "student-ce": "CE only",
    }


def _nan(d: dict, key: str) -> float:
    return d.get(key, float("nan"))


def cache_lines(report: dict) -> list[str]:
    caches = report.get("caches") or {"top-K": report["cache"]}
    lines = []
    for kind, c in caches.items():
        built = "" if c.get("build_s") is None else f", built in {c['build_s']:.0f} s"
        lines.append(
            f"{kind} cache: {c['tokens']:,} tokens, K={c['k']}, {c['bytes_per_token']:.1f} bytes/token{built}"
        )
    return lines


def summary_lines(report: dict) -> list[str]:
    training, models, gaps, name_of = (
        report["training"],
        report["models"],
        report.get("gap_closed", {}),
        labels(report),
    )
    lines = cache_lines(report)
    for name, t in training.items():
        lines.append(
            f"{name_of[name]}: {t['tokens']:,} training tokens, {t['tokens_per_s']:.0f} tokens/s (median step), "
            f"peak {t['peak_gib']:.2f} GiB, final loss {t['final_loss']:.4f}"
        )
    lines += [
        "",
        f"{'held-out Hamlet':<20}{'bits/byte':>10}{'KL full':>9}{'gap %':>7}{'top-1 agree':>13}",
    ]
    for name in (n for n in MODELS if n in models):
        m, gap = models[name], gaps.get(name)
        lines.append(
            f"{name_of[name]:<20}{m['text']['bits_per_byte']:>10.4f}{_nan(m['text'], 'kl_full'):>9.4f}"
            f"{'-' if gap is None else f'{100 * gap:.0f}':>7}"
            f"{_nan(m.get('vs_teacher', {}), 'top1_agreement'):>13.3f}"
        )
    lines.append(
        "KL full: KL(teacher || model) over the whole vocabulary, nats/token; gap %: share of the CE student's "
        "gap to the teacher in bits/byte closed"
    )
    if "chat" in report:
        lines += ["", *chat_lines(report["chat"])]
    lines.append("")
    lines.append(
        "step times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in report["timings_s"].items())
    )
    return lines


def write_report(out: str, report: dict) -> None:
    text = "\n".join(summary_lines(report))
    print(text)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.join(out, "demo.png"))
    wrote("demo", f"report.txt, report.json and demo.png in {out}")


def _bars(ax, report: dict, values: dict, ylabel: str, reference: float | None = None) -> None:
    """The trained students side by side, each bar labelled with its value; the teacher as a dashed line."""
    name_of = labels(report)
    names = [n for n in TRAINED if n in values]
    bars = ax.bar(
        [name_of[n] for n in names], [values[n] for n in names], color=[COLORS[n] for n in names]
    )
    ax.bar_label(bars, labels=[f"{values[n]:.3f}" for n in names], fontsize=8)
    low, high = min(values[n] for n in names), max(values[n] for n in names)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label="teacher")
        ax.legend(fontsize=8, loc="lower right")
        low = min(low, reference)
    ax.set_ylim(
        max(0.0, low - 0.25 * (high - low) - 0.05 * high), high + 0.15 * (high - low) + 0.02 * high
    )
    ax.set_ylabel(ylabel)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chat, models, name_of = report.get("chat"), report["models"], labels(report)
    fig, axes = plt.subplots(1, 4 if chat else 3, figsize=(18 if chat else 14, 4.2))
    ax_loss, ax_bpb, ax_kl = axes[:3]
    for name, t in report["training"].items():
        ax_loss.plot(
            range(1, len(t["curve"]) + 1), t["curve"], label=name_of[name], color=COLORS[name]
        )
    ax_loss.set(xlabel="step", ylabel="training loss per token (KD or CE)", yscale="log")
    ax_loss.legend(fontsize=8)
    bpb = {n: m["text"]["bits_per_byte"] for n, m in models.items()}
    _bars(ax_bpb, report, bpb, "held-out bits per byte (lower is better)", bpb.get("teacher"))
    kl = {n: m["text"]["kl_full"] for n, m in models.items() if "kl_full" in m["text"]}
    if kl:
        _bars(ax_kl, report, kl, "held-out KL(teacher || model), full vocab")
    if "student-init" in models:
        init = models["student-init"]["text"]
        note = f"untrained student: {init['bits_per_byte']:.2f} bits/byte"
        note += f", KL {init['kl_full']:.2f}" if "kl_full" in init else ""
        ax_bpb.set_title(note + " (not shown)", fontsize=8)
    if chat:  # the chat step: KL on held-out assistant tokens
        values = {n: v["kl_bucket"] for n, v in chat["models"].items()}
        _bars(axes[3], report, values, "held-out chat KL (bucket), assistant tokens")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
