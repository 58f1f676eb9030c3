"""The teacher engines `topkd cache build --engine NAME` can run, and what each can do.

    engine = ENGINES["hf"]
    teacher = engine.load("MODEL_DIR", dtype="bfloat16", device="cuda:0", k=100, tensor_parallel=1, seq_len=2048)

Every engine returns a TeacherEngine (topkd.cache.building.teacher): the build asks this table what an engine can do,
never which engine it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from topkd.cache.building.teacher import TeacherEngine, load_teacher
from topkd.cache.building.vllm_engine import VLLMTeacher


@dataclass(frozen=True)
class Engine:
    load: Callable[..., TeacherEngine]  # (source, *, dtype, device, k, tensor_parallel, seq_len)
    # one process per torchrun rank (False: one process; the engine runs its own workers)
    distributed: bool
    # sees every logit, so can store c_T and draw samples (False: its top-K only)
    full_vocabulary: bool


def _load_hf(
    source: str, *, dtype: str, device: str, k: int, tensor_parallel: int, seq_len: int
) -> TeacherEngine:
    # k, tensor_parallel, seq_len: chosen per call, or by torchrun
    return load_teacher(source, dtype, device)


def _load_vllm(
    source: str, *, dtype: str, device: str, k: int, tensor_parallel: int, seq_len: int
) -> TeacherEngine:
    return VLLMTeacher(source, k, dtype, tensor_parallel, seq_len)  # vLLM places itself on its GPUs


ENGINES = {
    "hf": Engine(_load_hf, distributed=True, full_vocabulary=True),
    "vllm": Engine(_load_vllm, distributed=False, full_vocabulary=False),
}
