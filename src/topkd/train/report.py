"""Where `topkd train` reports its metrics beside metrics.jsonl: --report-to none | tensorboard | wandb.

    topkd train ... --report-to tensorboard    # event files in OUT/tensorboard: tensorboard --logdir OUT
    topkd train ... --report-to wandb          # a wandb run in OUT/wandb, offline unless WANDB_MODE says otherwise

Every numeric field of each metrics row (loss, kd_loss, ce_loss, lr, grad_norm, tokens/s, peak GiB, ...) is
one scalar at x = step, written by rank 0. A resumed run continues the same record: TensorBoard drops the
events past the checkpoint it resumes from (they are recomputed), and wandb continues the run whose id is
kept in OUT/wandb_id. Nothing leaves the machine by default: `wandb sync OUT/wandb/offline-run-*` uploads.
Beside them, loss.png: the loss curve of metrics.jsonl (plot_losses), titled with the run and its objective.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from typing import Protocol

from topkd.base.files import write_atomic

REPORTERS = ("none", "tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0"}


class Reporter(Protocol):
    def log(self, row: dict) -> None: ...
    def close(self) -> None: ...


def require_reporter(kind: str) -> None:
    """Refuse an unknown reporter, or one whose package is missing, before anything loads."""
    if kind not in REPORTERS:
        raise ValueError(f"report_to: expected one of {REPORTERS}, got {kind!r}")
    if kind != "none":
        try:
            __import__(kind)
        except ImportError:
            raise ValueError(
                f"--report-to {kind}: expected the {kind} package, got none installed; pip install "
                f"'topkd[hf]' ({PACKAGES[kind]}), or --report-to none"
            ) from None


class _Nothing:
    def log(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, out: str, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events a killed run wrote past the checkpoint are dropped (those steps run again)
        self.writer = SummaryWriter(
            os.path.join(out, "tensorboard"), purge_step=first_step + 1 if first_step else None
        )

    def log(self, row: dict) -> None:
        for name, value in _scalars(row).items():
            self.writer.add_scalar(f"train/{name}", value, row["step"])
        self.writer.flush()  # a kill loses at most the row in flight, as metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: str, config: dict):
        import wandb

        id_path = os.path.join(out, "wandb_id")
        run_id = open(id_path).read().strip() if os.path.exists(id_path) else secrets.token_hex(4)
        write_atomic(id_path, run_id.encode())
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "topkd"),
            dir=out,
            id=run_id,
            resume="allow",
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, row: dict) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def open_reporter(kind: str, out: str, config: dict, first_step: int) -> Reporter:
    if kind == "tensorboard":
        return _TensorBoard(out, first_step)
    if kind == "wandb":
        return _Wandb(out, config)
    return _Nothing()


def _scalars(row: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def plot_losses(metrics_path: str, out: str, title: str = "") -> None:
    """loss.png: the loss per step (KD and CE parts when both train), titled with the run and its objective, a
    log axis with labelled ticks (a KD curve and a CE curve must not look alike)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter

    rows = [json.loads(line) for line in open(metrics_path)]
    rows = [r for r in rows if math.isfinite(r["loss"])]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], label="loss")
    for part in ("kd_loss", "ce_loss"):
        if rows and all(part in r for r in rows) and any(r[part] != r["loss"] for r in rows):
            ax.plot(steps, [r[part] for r in rows], label=part.replace("_", " "), alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss per counted token")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    # labels on the minor ticks too, when a decade is all there is
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    if ax.get_legend_handles_labels()[0][1:]:
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
