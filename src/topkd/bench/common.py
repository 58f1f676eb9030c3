"""What every benchmark driver shares: a measurement in a fresh process, an allocation failure as a result row,
the results table, and memory/time-vs-length plots."""

from __future__ import annotations

import json
import selectors
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch


def run_json_process(cmd: list[str], timeout_s: float, env: dict) -> dict:
    """Run one measurement process and return its JSON line; a kill (OOM killer) or a timeout is a result
    ({"status": "oom" | "timeout" | "error"}), never an exception."""
    return run_json_lines(cmd, ["row"], timeout_s, env)["row"]


def run_json_lines(cmd: list[str], keys: list, timeout_s: float, env: dict, on_row=None) -> dict:
    """Run a process that prints one JSON line per key (in order) and return {key: row}; each line must come
    within timeout_s of the previous one. A key without its line (timeout, crash, OOM kill) gets a row saying
    which, and the keys after it are marked skipped: one failing point never stops the others' processes.
    stderr goes to a temporary file, so a chatty process never blocks on a full pipe. on_row(key, row), if given,
    sees each line as it comes (a caller writes its results then, not only when the process ends)."""
    with tempfile.TemporaryFile(mode="w+") as err_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
        rows, ended = _read_rows(proc, list(keys), timeout_s, on_row)
        pending = [k for k in keys if k not in rows]
        if pending:
            # EOF on stdout means it is exiting (poll() may not see that yet: judging by it called a crash a
            # timeout under load); only a silent process past its deadline timed out
            timed_out = not ended
            if ended:
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:  # closed stdout but kept running: as good as hung
                    timed_out = True
            proc.kill()
            code = proc.wait()
            err_file.seek(0)
            status = "timeout" if timed_out else _exit_status(code)
            rows[pending[0]] = {
                "status": status,
                "error": err_file.read().strip().splitlines()[-1:],
            }
            rows.update(
                {
                    k: {"status": "skipped", "error": f"after {status} at {pending[0]}"}
                    for k in pending[1:]
                }
            )
        proc.wait()
    return rows


def _exit_status(code: int) -> str:
    """How a measurement process that printed no row ended: killed (the OOM killer's SIGKILL, 137 from a shell) is
    "oom", any other exit "error"."""
    return "oom" if code < 0 or code == 137 else "error"


def _read_rows(
    proc: subprocess.Popen, keys: list, timeout_s: float, on_row=None
) -> tuple[dict, bool]:
    """{key: row} for the JSON lines proc prints in time, in key order; and whether its stdout ended."""
    rows = {}
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while len(rows) < len(keys) and sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            if not line:  # the process ended
                return rows, True
            if line.startswith("{"):
                key = keys[len(rows)]
                rows[key] = json.loads(line)
                if on_row is not None:
                    on_row(key, rows[key])
                deadline = time.monotonic() + timeout_s
    return rows, False


def plot_vs_length(
    series: dict[str, tuple[list, list, list]],
    oom: dict[str, list[int]],
    ylabels: tuple[str, str],
    title: str,
    path: str,
    oom_level: float | None = None,
) -> None:
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


@dataclass(frozen=True)
class Column:
    """One column of a results table: its title, width, the row's value (None: blank) and its format spec."""

    title: str
    width: int
    value: Callable[[dict], object]
    spec: str = ""

    def cell(self, row: dict, first: bool) -> str:
        value = self.value(row)
        text = "" if value is None else format(value, self.spec)
        return f"{text:<{self.width}}" if first else f"{text:>{self.width}}"


def results_table(
    rows: list[dict],
    columns: list[Column],
    keys: int = 2,
    rule: bool = True,
    failures_in_short: bool = True,
) -> str:
    """Every benchmark's table: a header (and a rule), then one line per row. failures_in_short: a row whose status
    is not "ok" shows its first `keys` columns and its status in capitals, nothing after."""
    head = " ".join(
        [
            f"{c.title:<{c.width}}" if i == 0 else f"{c.title:>{c.width}}"
            for i, c in enumerate(columns)
        ]
    )
    lines = [head, "-" * len(head)] if rule else [head]
    for r in rows:
        if failures_in_short and r.get("status", "ok") != "ok":
            status = f"{r.get('status', '?').upper():>{columns[keys].width}}"
            lines.append(
                " ".join([c.cell(r, i == 0) for i, c in enumerate(columns[:keys])] + [status])
            )
        else:
            lines.append(" ".join([c.cell(r, i == 0) for i, c in enumerate(columns)]))
    return "\n".join(lines)


def series_by_impl(
    rows: list[dict], impls, memory_gib: Callable[[dict], float], time_key: str
) -> tuple[dict[str, tuple[list, list, list]], dict[str, list[int]]]:
    """plot_vs_length's inputs from result rows: per impl its ok points by length (memory in GiB, and the seconds
    of those that have time_key), and the lengths where it did not run (OOM, timeout, error)."""
    series, failed = {}, {}
    for impl in impls:
        ok = sorted(
            (r for r in rows if r["impl"] == impl and r.get("status") == "ok"),
            key=lambda r: r["tokens"],
        )
        timed = [r[time_key] for r in ok if time_key in r]
        series[impl] = ([r["tokens"] for r in ok], [memory_gib(r) for r in ok], timed)
        failed[impl] = [r["tokens"] for r in rows if r["impl"] == impl and r.get("status") != "ok"]
    return series, failed


def skipped_after_oom(rows: list[dict], impl: str, tokens: int) -> dict | None:
    """The row for a point not worth running: its impl already ran out of memory at a shorter length."""
    if any(r["impl"] == impl and r["status"] == "oom" and r["tokens"] < tokens for r in rows):
        return {"status": "oom", "error": "skipped: OOM at a shorter length"}
    return None


def measured(measure: Callable[[], dict]) -> dict:
    """measure()'s row with status "ok", or, when it runs out of memory, the "oom" row (anything else propagates).
    torch.OutOfMemoryError is a RuntimeError."""
    try:
        return {**measure(), "status": "ok"}
    except (MemoryError, RuntimeError) as e:
        oom = out_of_memory(e)
        if oom is None:
            raise
        return oom


def out_of_memory(e: BaseException) -> dict | None:
    """An exception as a result row if it is an allocation failure (CUDA, Python, or a CPU allocator hitting the
    address-space cap); None for anything else, which the caller re-raises."""
    message = str(e)
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError)
        and ("can't allocate memory" in message or "out of memory" in message.lower())
    ):
        return {
            "status": "oom",
            "error": message.splitlines()[0][:200] if message else type(e).__name__,
        }
    return None
