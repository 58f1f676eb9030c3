"""EngineRows: what every teacher engine (HF, vLLM, the sampler, the top-p cut) returns for a run of tokens.

    rows = teacher.topk_rows(input_ids, k=100)        # an EngineRows over the B*L tokens
    first = rows.slice(0, 512)                        # the rows of one sequence
    both = EngineRows.concat([first, rows.slice(512, 1024)])

Row t holds p(x_{t+1} | x_<=t). Every array has one entry per token; the K columns are in rank order (descending
log-prob), entries with log-prob -inf are padding (variable K). The shard encoder takes them with their sequence
(teacher_sequence: topkd.cache.format.shard.TeacherSequence).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from topkd.cache.format.shard import TeacherSequence


@dataclass(frozen=True)
class EngineRows:
    ids: np.ndarray  # [n, K] int32, rank order
    logprobs: np.ndarray  # [n, K] float32, normalised over the full vocabulary; -inf: padding
    log_mass: np.ndarray  # [n] float32, log of the kept entries' mass
    # [n] float32, log of the mass outside them (-inf: none, or sampled targets)
    log_tail: np.ndarray
    logz: np.ndarray  # [n, temperatures] float32, c_T = log sum_v exp(a_v / T)
    # [n, temperatures] float32, the kept entries' exact mass at T
    log_mass_t: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def slice(self, start: int, end: int) -> EngineRows:
        return self.map(lambda a: a[start:end])

    def map(self, fn) -> EngineRows:
        """The same rows with fn applied to every array (log_mass_t only where present)."""
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return EngineRows(**{name: None if a is None else fn(a) for name, a in arrays.items()})

    @staticmethod
    def concat(parts: list[EngineRows]) -> EngineRows:
        """Consecutive runs of rows as one (an engine's chunks, a sequence's documents)."""
        names = [f.name for f in dataclasses.fields(EngineRows)]
        joined = {n: [getattr(p, n) for p in parts] for n in names}
        return EngineRows(
            **{
                n: None if any(a is None for a in v) else np.concatenate(v)
                for n, v in joined.items()
            }
        )


def teacher_sequence(seq, rows: EngineRows) -> TeacherSequence:
    """One packed sequence and its teacher rows (from a TeacherEngine), as the shard encoder takes them."""
    return TeacherSequence(
        input_ids=seq.tokens,
        ids=rows.ids,
        logprobs=rows.logprobs,
        log_mass=rows.log_mass,
        log_tail=rows.log_tail,
        logz=rows.logz,
        doc_starts=seq.doc_starts,
        source_index=seq.index,
        token_offset=seq.token_offset,
        log_mass_t=rows.log_mass_t,
        row_mask=seq.row_mask,
    )
