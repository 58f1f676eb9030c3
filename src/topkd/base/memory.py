"""Peak memory, read one way everywhere: the CUDA allocator's peak on a GPU, the process's VmHWM on CPU.

    process_peak_bytes(torch.device("cpu"))    # peak resident set since start (or since clear_refs)
    reserved_peak_bytes(torch.device("cuda"))  # the CUDA caching allocator's reserved peak (None off CUDA)
    status_kib("VmRSS")                         # any /proc/self/status field, in KiB

tracemalloc does not see torch's allocations; VmHWM does (write 5 to /proc/self/clear_refs to reset it).
"""

from __future__ import annotations

import torch


def status_kib(field: str) -> int:
    """A /proc/self/status field (VmHWM, VmRSS, ...) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def process_peak_bytes(device: torch.device) -> float:
    """Peak CUDA memory allocated on a GPU; peak resident set of the process on CPU (nan where unreadable)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        return float(status_kib("VmHWM") * 1024)
    except (OSError, RuntimeError):
        return float("nan")


def reserved_peak_bytes(device: torch.device) -> float | None:
    """Peak bytes the CUDA caching allocator reserved (what decides an OOM near the device's capacity, beside the
    allocated peak); None where there is no such allocator."""
    if device.type != "cuda":
        return None
    return float(torch.cuda.max_memory_reserved(device))
