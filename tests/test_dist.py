"""topkd.base.dist device placement under NCCL, with a fake NCCL (CPU CI has only gloo): every rank binds its own
GPU from LOCAL_RANK before the process group exists, and collectives go to that GPU, never cuda:0."""

import torch
import torch.distributed as tdist

from topkd.base import dist


def test_init_binds_local_rank_before_the_process_group(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(tdist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        tdist, "init_process_group", lambda backend, **kw: calls.append((backend, kw))
    )
    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 3)
    assert dist.init("cuda") == (3, 4)
    assert calls == [("set_device", 3), ("nccl", {"device_id": torch.device("cuda", 3)})]
    assert dist.local_device("cuda") == "cuda:3"


def test_collectives_use_this_ranks_gpu_under_nccl_and_the_cpu_under_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(tdist, "get_backend", lambda group=None: "nccl")
    assert dist.collective_device() == torch.device("cuda", 2)
    monkeypatch.setattr(tdist, "get_backend", lambda group=None: "gloo")
    assert dist.collective_device() == torch.device("cpu")
