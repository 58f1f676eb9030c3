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
    # [n] bool, where an engine could not score every row (a served teacher that read other tokens): False
    # rows are valid placeholders the loss must leave out
    scored: np.ndarray | None = None

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


TAIL_FLOOR = float(np.log(np.finfo(np.float32).tiny))  # log of a tail that rounds to zero in fp32


def ranked_rows(
    entries: list[list[tuple[int, float]]], k: int, scored: np.ndarray | None = None
) -> EngineRows:
    """Rows from what an engine that gives only its top entries returns (vLLM, a served teacher): per row up to k
    (id, log-prob) pairs, in any order. Rank order, -inf padding where a row has fewer than k, and a tail of
    log(1 - kept mass) (not summed directly: the rest of the vocabulary is not seen); no c_T."""
    n = len(entries)
    ids = np.zeros((n, k), np.int32)
    logprobs = np.full((n, k), -np.inf, np.float32)
    for t, entry in enumerate(entries):
        top = sorted(entry, key=lambda e: (-e[1], e[0]))[:k]
        if not top:
            raise ValueError(f"teacher rows: expected at least one entry at row {t}, got none")
        ids[t] = top[0][0]  # padding repeats the first id, as the cache's variable-K rows do
        ids[t, : len(top)] = [i for i, _ in top]
        logprobs[t, : len(top)] = [lp for _, lp in top]
    log_mass = np.logaddexp.reduce(logprobs.astype(np.float64), axis=1)
    with np.errstate(divide="ignore"):  # a top-K holding all the mass leaves a zero tail: the floor
        tail = np.log(-np.expm1(np.minimum(log_mass, 0.0)))
    return EngineRows(
        ids=ids,
        logprobs=logprobs,
        log_mass=log_mass.astype(np.float32),
        log_tail=np.maximum(tail, TAIL_FLOOR).astype(np.float32),
        logz=np.zeros((n, 0), np.float32),
        scored=scored,
    )


def teacher_sequence(seq, rows: EngineRows) -> TeacherSequence:
    """One packed sequence and its teacher rows (from a TeacherEngine), as the shard encoder takes them."""
    if rows.scored is not None and not rows.scored.all():
        raise ValueError(
            f"teacher rows of sequence {seq.index}: expected every row scored, got "
            f"{int((~rows.scored).sum())} the engine could not score; a cache holds no placeholders"
        )
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
        text=seq.text,
        char_len=seq.char_len,
    )
