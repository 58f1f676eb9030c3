"""Training samples from a top-K cache: seeded order, re-slicing to any length, document masks.

    stream = SampleStream(cache, seq_len=1024, seed=0)
    batch = stream.batch(first_sample=0, size=8)     # tensors [8, 1024(, K)]; deterministic in (seed, index)

Each epoch visits every cached sequence once in a seeded random order; their rows are laid
end to end and cut into samples of seq_len rows, so --seq-len may differ from the cache's.
A sample restarts positions (and so attention, see topkd.cache.data.position_ids) at every
document start and at every cached-sequence boundary, which is exactly the context the teacher
saw. No loss is taken across a document boundary: the row of each separator token (whose next
token opens another document) is masked, and so is the hard label at the end of each piece.
Samples are addressed by a global index, so resuming needs only the number consumed.
"""
from __future__ import annotations

import numpy as np
import torch

from topkd.cache import TopKCache
from topkd.cache.data import position_ids


class SampleStream:
    """Samples over a sequence source: a TopKCache, or a teacher run on the fly (topkd.train.online)."""

    def __init__(self, source: TopKCache, seq_len: int, seed: int, temperature_column: int | None = None):
        self.source, self.seq_len, self.seed, self.logz_column = source, seq_len, seed, temperature_column
        self.lengths = source.sequence_lengths()
        self.per_epoch = -(-sum(self.lengths) // seq_len)  # pieces fill samples in order: the count is fixed
        self.separator = source.separator
        self._plans: dict[int, list[list[tuple[int, int, int]]]] = {}
        self._decoded: tuple[int, dict] | None = None

    def plan(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        """Samples of one epoch, each a list of (sequence, first row, end row) pieces."""
        if epoch not in self._plans:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            samples, current, filled = [], [], 0
            order = torch.randperm(len(self.lengths), generator=g).tolist()
            full = max(self.lengths, default=0)
            # short sequences (the end of the data) go last, so they cannot shift every later sample off the
            # teacher's sequence boundaries: with --seq-len equal to the cache's, samples are whole sequences
            for i in [i for i in order if self.lengths[i] == full] + [i for i in order if self.lengths[i] < full]:
                pos = 0
                while pos < self.lengths[i]:
                    take = min(self.seq_len - filled, self.lengths[i] - pos)
                    current.append((i, pos, pos + take))
                    filled, pos = filled + take, pos + take
                    if filled == self.seq_len:
                        samples.append(current)
                        current, filled = [], 0
            if current:
                samples.append(current)  # a short last sample, padded and masked, never dropped
            self._plans = {epoch: samples}  # one epoch at a time is enough for a sequential reader
        return self._plans[epoch]

    def locate(self, index: int) -> list[tuple[int, int, int]]:
        return self.plan(index // self.per_epoch)[index % self.per_epoch]

    def _sequence(self, i: int) -> dict:
        if self._decoded is None or self._decoded[0] != i:
            self._decoded = (i, self.source[i])
        return self._decoded[1]

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        pieces = [self._piece(i, a, e) for i, a, e in self.locate(index)]
        out = {name: torch.cat([p[name] for p in pieces]) for name in pieces[0]}
        out["position_ids"] = torch.from_numpy(position_ids(len(out["input_ids"]), out.pop("doc_start").nonzero()
                                                            .squeeze(1).numpy()))
        return _pad(out, self.seq_len)

    def _piece(self, i: int, a: int, e: int) -> dict[str, torch.Tensor]:
        row = self._sequence(i)
        ids = row["input_ids"][a:e]
        doc_start = row["doc_start"][a:e].clone()
        doc_start[0] = True  # a piece cut mid-sequence starts a fresh context: the student sees less than the teacher
        mask = torch.ones(e - a, dtype=torch.bool)
        if self.separator is not None:
            mask &= ids != self.separator  # the separator's row predicts the next document's first token
        labels = torch.full((e - a,), -100, dtype=torch.long)
        labels[:-1] = torch.where(mask[:-1], ids[1:], -100)
        logz = row["logz"][a:e, self.logz_column] if self.logz_column is not None else torch.zeros(e - a)
        return {"input_ids": ids, "teacher_ids": row["teacher_ids"][a:e],
                "teacher_logprobs": row["teacher_logprobs"][a:e], "teacher_logz": logz, "mask": mask,
                "labels": labels, "doc_start": doc_start}

    def batch(self, first_sample: int, size: int) -> dict[str, torch.Tensor]:
        samples = [self.sample(first_sample + j) for j in range(size)]
        return {name: torch.stack([s[name] for s in samples]) for name in samples[0]}


def _pad(sample: dict[str, torch.Tensor], seq_len: int) -> dict[str, torch.Tensor]:
    n = len(sample["input_ids"])
    if n == seq_len:
        return sample
    pad = seq_len - n
    out = {}
    for name, t in sample.items():
        fill = -100 if name == "labels" else 0
        out[name] = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    out["position_ids"][n:] = torch.arange(pad) + (int(sample["position_ids"][-1]) + 1)
    out["mask"][n:] = False  # padded rows are masked; distinct ids keep them well-formed anyway
    out["teacher_ids"][n:] = torch.arange(out["teacher_ids"].shape[1])
    out["teacher_logprobs"][n:] = -30.0
    return out


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["mask"].sum())


def logz_column(source: TopKCache, temperature: float, tail: str) -> int | None:
    """The source's column holding c_T for this temperature; None when not needed. Refuses a missing one."""
    if temperature == 1.0 or tail == "renorm":
        return None
    temps = [float(t) for t in source.temperatures]
    if temperature not in temps:
        raise ValueError(f"temperature {temperature} with tail='bucket' needs c_T stored in the cache, which has "
                         f"temperatures {temps}; rebuild the cache with --temperatures {temperature:g}, or use "
                         "--tail renorm")
    return temps.index(temperature)
