"""The demo's report: report.txt (what a reader wants first), report.json (everything), demo.png (curves, bars)."""

from __future__ import annotations

import json
import os

from topkd.demo_chat import chat_lines
from topkd.progress import wrote

MODELS = ("teacher", "student-init", "student-kd", "student-ce")


def summary_lines(report: dict) -> list[str]:
    cache, training, models = report["cache"], report["training"], report["models"]
    lines = [
        f"cache: {cache['tokens']:,} tokens, K={cache['k']}, {cache['bytes_per_token']:.1f} bytes/token, built in "
        f"{cache['build_s']:.0f} s"
        if cache.get("build_s") is not None
        else f"cache: {cache['tokens']:,} tokens, K={cache['k']}, {cache['bytes_per_token']:.1f} bytes/token"
    ]
    for name, t in training.items():
        lines.append(
            f"{name}: {t['tokens']:,} training tokens, {t['tokens_per_s']:.0f} tokens/s (median step), "
            f"peak {t['peak_gib']:.2f} GiB, final loss {t['final_loss']:.4f}"
        )
    lines.append("")
    lines.append(
        f"{'held-out Hamlet':<16}{'bits/byte':>11}{'KL bucket':>11}{'KL renorm':>11}{'top-1 agree':>13}"
    )
    for name in MODELS:
        m = models.get(name)
        if m is None:
            continue
        v = m.get("vs_teacher", {})
        lines.append(
            f"{name:<16}{m['text']['bits_per_byte']:>11.4f}{v.get('kl_bucket', float('nan')):>11.4f}"
            f"{v.get('kl_renorm', float('nan')):>11.4f}{v.get('top1_agreement', float('nan')):>13.3f}"
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


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chat = report.get("chat")
    fig, axes = plt.subplots(1, 4 if chat else 3, figsize=(17 if chat else 13, 3.8))
    ax_loss, ax_bpb, ax_kl = axes[:3]
    for name, t in report["training"].items():
        ax_loss.plot(range(1, len(t["curve"]) + 1), t["curve"], label=name)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss per token (KD or CE)")
    ax_loss.set_yscale("log")
    ax_loss.legend(fontsize=8)
    names = [n for n in MODELS if n in report["models"]]
    ax_bpb.bar(
        names, [report["models"][n]["text"]["bits_per_byte"] for n in names], color="tab:blue"
    )
    ax_bpb.set_ylabel("held-out bits per byte (lower is better)")
    ax_kl.bar(
        names,
        [report["models"][n].get("vs_teacher", {}).get("kl_bucket", 0.0) for n in names],
        color="tab:orange",
    )
    ax_kl.set_ylabel("held-out KL(teacher || model), nats/token")
    if chat:  # the chat step: KL on held-out assistant tokens
        chat_names = [n for n in MODELS if n in chat["models"]]
        axes[3].bar(
            chat_names, [chat["models"][n]["kl_bucket"] for n in chat_names], color="tab:green"
        )
        axes[3].set_ylabel("held-out chat KL, assistant tokens")
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
