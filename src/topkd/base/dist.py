"""torch.distributed in one place: the same code runs as one plain process or under torchrun.

    rank, world = topkd.base.dist.init("cpu")      # (0, 1) without torchrun; gloo on CPU, nccl on CUDA
    tokens = topkd.base.dist.all_sum(local_tokens)
    topkd.base.dist.shutdown()                     # a finished job's end: every rank together

Every helper is a no-op (returns its input) when there is one process, so callers never branch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_STARTED = []  # the process group init() started (one a caller started is the caller's to end)


def init(device: str) -> tuple[int, int]:
    """(rank, world) under torchrun, initialising the process group once; (0, 1) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        _STARTED.append(True)
    if not dist.is_initialized() and device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)  # else every rank's collectives and .cuda() land on cuda:0
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    elif not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), world


def shutdown() -> None:
    """End a job that finished: every rank waits for the others (a barrier), then the process group init()
    started is destroyed. A rank that exited while a peer still worked (rank 0 saving final/) left gloo's
    threads to the interpreter's exit, which could abort it (SIGABRT, "terminate called without an active
    exception") and torchrun then stopped the peer."""
    if _STARTED and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _STARTED.clear()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def local_device(device: str) -> str:
    """cuda -> cuda:LOCAL_RANK (one GPU per process); cpu stays cpu."""
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if device == "cuda" else device


def all_sum(value: float) -> float:
    return _reduce(value, dist.ReduceOp.SUM)


def all_max(value: float) -> float:
    return _reduce(value, dist.ReduceOp.MAX)


def collective_device(group=None) -> torch.device:
    """Where a group's collectives take their tensors: this process's GPU under NCCL (the one init() set from
    LOCAL_RANK, never cuda:0 on every rank), the CPU under gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(value: float, op) -> float:
    if not active():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=op)
    return float(t.item())


def barrier() -> None:
    if active():
        dist.barrier()
