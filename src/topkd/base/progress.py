"""Progress a person can follow: a tqdm bar on a terminal, a plain line every ~30 s in a log file.

    bar = progress(total=1000, desc="cache build", unit="tok")
    bar.update(48); bar.set_postfix(shards=3); bar.close()

When stderr is not a terminal (a cluster log, CI, `| tee`), tqdm would either print nothing
(disable=None) or fill the log with carriage returns; `PlainProgress` instead writes one line
`desc: 480/1,000 tok (48%), 12.5 tok/s, ETA 41s, shards=3` every TOPKD_PROGRESS_SECONDS (default
30), from a timer thread, so a line comes on time however long one unit of work takes, and once at
the end. The count is what is done; `skipped(bar, n)` advances past work a resumed job finds done
without counting it in the rate, so the ETA is that of the work left. TQDM_DISABLE=1 silences both.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref

from tqdm import tqdm

INTERVAL_S = 30.0


def count(n: int, noun: str) -> str:
    """ "1 shard", "5 shards", "1,774 tokens": numbers as a person writes them."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def wrote(command: str, what: str) -> None:
    """The last word of a command, on stderr (stdout's last line stays the command's JSON where it has one)."""
    print(f"topkd {command}: wrote {what}", file=sys.stderr, flush=True)


def track(items, desc: str, unit: str = "it", total: int | None = None):
    """Iterate items with progress (tqdm on a terminal, plain lines in a log)."""
    bar = progress(total=total if total is not None else len(items), desc=desc, unit=unit)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:  # also when the consumer stops early or raises: no timer left printing
        bar.close()


def progress(
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    initial: int = 0,
    disable: bool = False,
):
    """A tqdm bar on a terminal, else a PlainProgress; both take update/set_postfix/close."""
    if disable or os.environ.get("TQDM_DISABLE", "") not in ("", "0"):
        return PlainProgress(total, desc, unit, initial, silent=True)
    if sys.stderr.isatty():
        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            initial=initial,
            unit_scale=unit == "tok",
            dynamic_ncols=True,
        )
    return PlainProgress(total, desc, unit, initial)


def skipped(bar, n: int) -> None:
    """Advance a bar past n units found already done (a resumed job): counted, but not in the rate."""
    if isinstance(bar, PlainProgress):
        bar.n, bar.start_n = bar.n + n, bar.start_n + n
    else:
        bar.update(n)


class PlainProgress:
    """tqdm's little interface, printing a plain line every interval seconds (a timer thread) and at close."""

    def __init__(
        self, total: int | None, desc: str, unit: str, initial: int = 0, silent: bool = False
    ):
        self.total, self.desc, self.unit, self.n, self.silent = total, desc, unit, initial, silent
        self.interval = float(os.environ.get("TOPKD_PROGRESS_SECONDS", INTERVAL_S))
        self.start_n, self.start = initial, time.monotonic()
        self.last, self.postfix, self.printed_n = self.start, "", initial
        self._closed, self._lock = threading.Event(), threading.Lock()
        # the thread holds a weak reference: a bar dropped unclosed stops it
        if not silent and self.interval > 0:
            threading.Thread(
                target=_beat,
                args=(weakref.ref(self), self._closed),
                name=f"progress: {desc}",
                daemon=True,
            ).start()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._print()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        self._closed.set()
        if self.n != self.printed_n:
            self._print()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = (self.n - self.start_n) / elapsed
        parts = [
            f"{self.desc}: {self.n:,}"
            + (f"/{self.total:,}" if self.total else "")
            + f" {self.unit}"
        ]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.3g} {self.unit}/s")
        if self.total and rate > 0:
            parts.append(f"ETA {_duration(max(self.total - self.n, 0) / rate)}")
        return ", ".join(parts + ([self.postfix] if self.postfix else []))

    def _print(self) -> None:
        with self._lock:  # the timer thread and update() may both decide it is time
            self.last, self.printed_n = time.monotonic(), self.n
            if not self.silent:
                print(self.line(), file=sys.stderr, flush=True)


def _beat(ref: "weakref.ref[PlainProgress]", closed: threading.Event) -> None:
    """The timer: a line every interval until the bar is closed, or dropped."""
    while not closed.wait(1.0 if (bar := ref()) is None else min(bar.interval, 1.0)):
        if bar is None:
            return
        if time.monotonic() - bar.last >= bar.interval:
            bar._print()
        del bar


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
