"""What every benchmark driver shares: a measurement in a fresh process, and memory/time-vs-length plots."""
from __future__ import annotations

import json
import subprocess


def run_json_process(cmd: list[str], timeout_s: int, env: dict) -> dict:
    """Run one measurement process and return its last JSON line; a kill (OOM killer) or a timeout is a
    result ({"status": "oom" | "timeout" | "error"}), never an exception."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    killed = proc.returncode < 0 or proc.returncode == 137
    return {"status": "oom" if killed else "error", "error": proc.stderr.strip().splitlines()[-1:]}


def plot_vs_length(series: dict[str, tuple[list, list, list]], oom: dict[str, list[int]], ylabels: tuple[str, str],
                   title: str, path: str, oom_level: float | None = None) -> None:
    """Two log-log panels, memory and time against tokens, one line per impl.

    series: impl -> (tokens, memory GiB, seconds; seconds may be shorter for points without a time).
    OOM points are marked at oom_level (an x) or, without one, as a dotted vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, (tokens, memory, seconds) in series.items():
        if tokens:
            ax_mem.plot(tokens, memory, "o-", label=impl)
            ax_time.plot(tokens[: len(seconds)], seconds, "o-", label=impl)
        for n in oom.get(impl, []):
            if oom_level is None:
                ax_mem.axvline(n, color="grey", ls=":", lw=0.8)
            else:
                ax_mem.plot([n], [oom_level], "x", color="grey")
    if oom_level is not None:
        ax_mem.axhline(oom_level, color="grey", ls=":", lw=0.8)
    for ax, ylabel in zip((ax_mem, ax_time), ylabels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
