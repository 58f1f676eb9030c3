"""Stamp for stored benchmark results: machine, versions, commit, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

import torch

from topkd.base.version import __version__


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return float("nan")


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp(device: str = "cpu") -> dict:
    """Where and with what a result was measured."""
    if device.startswith("cuda") and torch.cuda.is_available():
        machine = torch.cuda.get_device_name(0)
    else:
        machine = f"{_cpu_model()} x{os.cpu_count()} cores, {_mem_gib()} GiB"
    return {
        "machine": machine,
        "device": device,
        "torch": torch.__version__,
        "topkd": __version__,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
