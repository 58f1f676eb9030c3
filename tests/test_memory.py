"""topkd.base.memory: peak memory read one way (CPU VmHWM; on CUDA the allocated peak and, beside it, the reserved)."""

import torch

from topkd.base import memory
from topkd.bench.point import PeakMemory


def test_cpu_has_a_resident_peak_and_no_reserved_pool():
    cpu = torch.device("cpu")
    assert memory.process_peak_bytes(cpu) >= memory.status_kib("VmRSS") * 1024 > 0
    assert memory.reserved_peak_bytes(cpu) is None and PeakMemory(cpu).reserved() == {}


def test_cuda_measurements_record_the_reserved_peak_beside_the_allocated(monkeypatch):
    """The CUDA reads are the allocator's own counters (faked here: no GPU on this machine)."""
    calls = []
    monkeypatch.setattr(
        torch.cuda, "max_memory_reserved", lambda device=None: calls.append(device) or 6 * 2**30
    )
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**30)
    assert memory.reserved_peak_bytes(torch.device("cuda")) == 6 * 2**30
    assert (
        PeakMemory(torch.device("cuda")).reserved() == {"peak_reserved_bytes": 6 * 2**30}
        and len(calls) == 2
    )
