"""The metrics that see the tail: calibration of next-token predictions, and (with a live teacher) the
full-vocabulary divergence and speculative acceptance a top-K cache cannot show.

    calib = calibration(confidence, correct, bins=15)    # ECE over equal-width bins of top-1 confidence
    reliability_plot(calib, "reliability.png", "student-kd")

ECE = sum_b (n_b / n) |accuracy_b - confidence_b| over equal-width bins of the top-1 probability (a bin
holds lo <= c < hi, the last one also c = 1); accuracy is how often the top-1 is the actual next token. A
student distilled towards a teacher's top-K is pushed into the head and comes out over-confident: its
confidence exceeds its accuracy in the upper bins (Anshumann et al., ACL 2025). Full-vocabulary KL and
acceptance (sum_v min(p_v, q_v) = 1 - TVD) are per scored token: topkd/eval/heads.py:paired_divergences.
"""

from __future__ import annotations

import numpy as np

CALIBRATION_BINS = 15


def calibration(confidence: np.ndarray, correct: np.ndarray, bins: int = CALIBRATION_BINS) -> dict:
    """{"ece", "bins": [{lo, hi, count, confidence, accuracy}]} of top-1 confidences in [0, 1] and their hits."""
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, bool)
    if confidence.shape != correct.shape or confidence.ndim != 1 or not len(confidence):
        raise ValueError(
            f"calibration: expected two equal non-empty 1-D arrays, got {confidence.shape} and "
            f"{correct.shape}"
        )
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, confidence, side="right") - 1, 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        inside = which == b
        n = int(inside.sum())
        conf = float(confidence[inside].mean()) if n else None
        acc = float(correct[inside].mean()) if n else None
        if n:
            ece += n / len(confidence) * abs(acc - conf)
        table.append(
            {
                "lo": float(edges[b]),
                "hi": float(edges[b + 1]),
                "count": n,
                "confidence": conf,
                "accuracy": acc,
            }
        )
    return {"ece": ece, "bins": table}


def reliability_plot(calib: dict, path: str, title: str) -> None:
    """The reliability diagram: accuracy per confidence bin against the diagonal, bin counts below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = [b for b in calib["bins"] if b["count"]]
    fig, (ax, counts) = plt.subplots(
        2, 1, figsize=(5, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    width = calib["bins"][0]["hi"] - calib["bins"][0]["lo"]
    ax.bar(
        [b["lo"] for b in full],
        [b["accuracy"] for b in full],
        width=width,
        align="edge",
        alpha=0.7,
        edgecolor="k",
        label="accuracy of the top-1",
    )
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.plot(
        [b["confidence"] for b in full],
        [b["accuracy"] for b in full],
        "o",
        ms=3,
        color="C3",
        label="(mean confidence, accuracy)",
    )
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title}: ECE {calib['ece']:.4f}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    counts.bar(
        [b["lo"] for b in full], [b["count"] for b in full], width=width, align="edge", color="grey"
    )
    counts.set_yscale("log")
    counts.set_xlabel("top-1 confidence")
    counts.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
