"""SIGINT and SIGTERM (a cluster's preemption notice) as something a long job can act on.

    with stop_requests() as stop:       # train: finish the step, save a checkpoint, then stop
        ...; if stop.signum: ...
    with signals_raise():               # cache build: drop the shard in flight (no temp file left), stop

Both raise or report `Interrupted(signum)`, which the CLI turns into one line and exit code 128 + signum.
"""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal after saving what it could; the message says what and how to resume."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum, self.message = signum, message or f"stopped by {signal.Signals(signum).name}"


class StopRequest:
    signum: int = 0


@contextlib.contextmanager
def stop_requests():
    """Record a SIGINT/SIGTERM instead of dying; the caller checks `.signum` at a safe point."""
    request = StopRequest()

    def record(signum, frame):
        request.signum = signum

    with _handlers(record):
        yield request


@contextlib.contextmanager
def signals_raise():
    """Turn SIGTERM (and SIGINT) into Interrupted, so `finally` blocks and temp-file cleanup run."""

    def interrupt(signum, frame):
        raise Interrupted(signum)

    with _handlers(interrupt):
        yield


@contextlib.contextmanager
def _handlers(handler):
    # signals reach the main thread only
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
