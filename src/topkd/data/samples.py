"""Training samples from a top-K cache: seeded order, re-slicing to any length, document masks.

    stream = SampleStream(cache, seq_len=1024, seed=0)
    batch = stream.batch(first_sample=0, size=8)     # tensors [8, 1024(, K)]; deterministic in (seed, index)

Each epoch visits every cached sequence once in a seeded random order; their rows are laid
end to end and cut into samples of seq_len rows, so --seq-len may differ from the cache's.
A sample restarts positions (and so attention, see topkd.data.documents.position_ids) at every
document start and at every cached-sequence boundary, which is exactly the context the teacher
saw. No loss is taken across a document boundary: the row of each separator token (whose next
token opens another document) is masked, and so is the hard label at the end of each piece.
Samples are addressed by a global index, so resuming needs only the number consumed.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from topkd.data.documents import position_ids

PACKINGS = ("documents", "cross", "none")
# per-row keys a source may add beside the teacher rows, carried through slicing and padding (0 past the end):
# the cross-tokenizer source's (topkd.train.cross)
EXTRA_ROW_KEYS = ("cross_kind", "chain_len", "uld_rest")


class SequenceSource(Protocol):
    """Where teacher rows come from: a TopKCache (topkd.cache), or a teacher run on the fly (topkd.train.online).
    SampleStream, TopKDataset, `topkd train` and KDTrainer read these members and no others."""

    path: str  # where the rows come from: the cache directory, or the online teacher's
    vocab_size: int  # the teacher's vocabulary (student rows beyond it are padding)
    k: int  # entries per row (0: the full vocabulary, in id order)
    seq_len: int  # tokens per sequence as the rows were made (the last may be shorter)
    temperatures: list[float]  # the T whose c_T each row carries, one logz column each
    separator: int | None  # the token between packed documents
    targets: str  # the name of its kind of target: topk | sampled | topp
    # what that kind stores and allows: a topkd.cache.format.targets.TargetKind (data sits below cache: not typed here)
    target_kind: object
    teacher_dir: str  # where the teacher was loaded from
    tokens: int  # rows of all sequences
    counted_tokens: int  # rows that count for the loss (chat data: the assistant targets)

    def __len__(self) -> int: ...
    # one sequence's rows: SEQUENCE_KEYS
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]: ...
    def sequence_lengths(self) -> list[int]: ...
    # per sequence: where documents begin, 0 first
    def document_starts(self) -> list[np.ndarray]: ...
    # refuses a student it cannot teach
    def check_student(self, vocab_size: int, tokenizer=None) -> None: ...
    def load_teacher(self): ...  # the teacher (what --init-from-teacher copies layers from)


# tests/data/test_samples.py holds it to the protocol
SOURCE_MEMBERS = (
    "path",
    "vocab_size",
    "k",
    "seq_len",
    "temperatures",
    "separator",
    "targets",
    "target_kind",
    "teacher_dir",
    "tokens",
    "counted_tokens",
    "__len__",
    "__getitem__",
    "sequence_lengths",
    "document_starts",
    "check_student",
    "load_teacher",
)


def missing_members(source) -> list[str]:
    """The SequenceSource members an object lacks (none: it can be read as one)."""
    return [name for name in SOURCE_MEMBERS if not hasattr(source, name)]


class SampleStream:
    """Samples over a sequence source: a TopKCache, or a teacher run on the fly (topkd.train.online).

    packing: "documents" (default) lays rows end to end and restarts attention at every document;
    "cross" packs the same way but attends across documents (naive packing, for ablations); "none"
    makes every document (or seq_len piece of one) its own sample, padded to the batch's longest."""

    def __init__(
        self,
        source: SequenceSource,
        seq_len: int,
        seed: int,
        logz_column: int | None = None,
        packing: str = "documents",
    ):
        if packing not in PACKINGS:
            raise ValueError(f"packing: expected one of {PACKINGS}, got {packing!r}")
        self.source, self.seq_len, self.seed, self.logz_column = source, seq_len, seed, logz_column
        self.packing = packing
        self.lengths = source.sequence_lengths()
        self.units = (
            _document_pieces(source.document_starts(), self.lengths, seq_len)
            if packing == "none"
            else None
        )
        # pieces fill samples in order: the count per epoch is fixed
        self.per_epoch = (
            len(self.units) if self.units is not None else -(-sum(self.lengths) // seq_len)
        )
        self.separator = source.separator
        self._plans: dict[int, list[list[tuple[int, int, int]]]] = {}
        self._decoded: tuple[int, dict] | None = None

    def plan(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        """Samples of one epoch, each a list of (sequence, first row, end row) pieces."""
        if epoch not in self._plans:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            if self.units is not None:
                samples = [
                    [self.units[i]] for i in torch.randperm(len(self.units), generator=g).tolist()
                ]
            else:
                samples = self._packed_plan(torch.randperm(len(self.lengths), generator=g).tolist())
            self._plans = {epoch: samples}  # one epoch at a time is enough for a sequential reader
        return self._plans[epoch]

    def _packed_plan(self, order: list[int]) -> list[list[tuple[int, int, int]]]:
        samples, current, filled = [], [], 0
        full = max(self.lengths, default=0)
        # short sequences (the end of the data) go last, so they cannot shift every later sample off the
        # teacher's sequence boundaries: with --seq-len equal to the cache's, samples are whole sequences
        for i in [i for i in order if self.lengths[i] == full] + [
            i for i in order if self.lengths[i] < full
        ]:
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
        return samples

    def locate(self, index: int) -> list[tuple[int, int, int]]:
        return self.plan(index // self.per_epoch)[index % self.per_epoch]

    def _sequence(self, i: int) -> dict:
        # the last sequence decoded, kept: samples share it
        if self._decoded is None or self._decoded[0] != i:
            self._decoded = (i, self.source[i])
        return self._decoded[1]

    def item(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index` (global: epoch * per_epoch + position) unpadded, as topkd.TopKDataset gives it."""
        pieces = [self._piece(i, a, e) for i, a, e in self.locate(index)]
        out = {name: torch.cat([p[name] for p, _ in pieces]) for name in pieces[0][0]}
        offsets = np.cumsum([0] + [len(p["input_ids"]) for p, _ in pieces])
        starts = (
            np.concatenate([s + o for (_, s), o in zip(pieces, offsets)])
            if self.packing != "cross"
            else [0]
        )
        out["position_ids"] = torch.from_numpy(position_ids(len(out["input_ids"]), starts))
        return out

    def sample(self, index: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
        return _pad(self.item(index), pad_to or self.seq_len)

    def _piece(self, i: int, a: int, e: int) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """Rows [a, e) of sequence i as sample tensors, and where documents start in them (0 first: a piece cut
        mid-sequence starts a fresh context, so the student sees less than the teacher there)."""
        row = self._sequence(i)
        ids = row["input_ids"][a:e]
        starts = row["doc_starts"].numpy()
        starts = np.union1d([0], starts[(starts > a) & (starts < e)] - a)
        mask = (
            row["row_mask"][a:e].clone()
            if "row_mask" in row
            else torch.ones(e - a, dtype=torch.bool)
        )
        if self.separator is not None:
            # the separator's row predicts the next document's first token
            mask &= ids != self.separator
        labels = torch.full((e - a,), -100, dtype=torch.long)
        labels[:-1] = torch.where(mask[:-1], ids[1:], -100)
        piece = {
            "input_ids": ids,
            "labels": labels,
            "kd_mask": mask,
            "teacher_ids": row["teacher_ids"][a:e],
            "teacher_logprobs": row["teacher_logprobs"][a:e],
        }
        piece.update({name: row[name][a:e] for name in EXTRA_ROW_KEYS if name in row})
        # c_T for the loss's temperature, only where the loss needs it
        if self.logz_column is not None:
            piece["teacher_logz"] = row["logz"][a:e, self.logz_column]
        return piece, starts

    def forget_decoded(self) -> None:
        """Drop the one decoded sequence kept between samples (the next read decodes from the source again)."""
        self._decoded = None

    def batch(self, first_sample: int, size: int) -> dict[str, torch.Tensor]:
        """Samples [first_sample, first_sample + size), padded to the longest of them (not to seq_len: a short
        last sample, or a cache of sequences shorter than --seq-len, costs no padded compute)."""
        return collate([self.item(i) for i in range(first_sample, first_sample + size)])


def _document_pieces(
    starts: list[np.ndarray], lengths: list[int], seq_len: int
) -> list[tuple[int, int, int]]:
    """(sequence, first row, end row) of every document in the source, cut into pieces of <= seq_len rows."""
    pieces = []
    for i, (doc_starts, length) in enumerate(zip(starts, lengths)):
        bounds = [int(b) for b in doc_starts] + [length]
        for a, e in zip(bounds[:-1], bounds[1:]):
            pieces.extend((i, p, min(p + seq_len, e)) for p in range(a, e, seq_len))
    return pieces


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples (TopKDataset items) padded to the longest of them and stacked: [B, L(, K)] tensors."""
    if not samples:
        raise ValueError("collate: expected at least one sample, got an empty list")
    for i, sample in enumerate(samples):
        _check_sample(sample, i)
    longest = max(len(s["input_ids"]) for s in samples)
    padded = [_pad(s, longest) for s in samples]
    return {name: torch.stack([s[name] for s in padded]) for name in padded[0]}


SAMPLE_KEYS = ("input_ids", "position_ids", "labels", "kd_mask", "teacher_ids", "teacher_logprobs")


def _check_sample(sample, i: int) -> None:
    """An item as TopKDataset makes it; anything else is refused with the way to get one (never trained on)."""
    hint = (
        "read the cache through topkd.TopKDataset (for TRL's SFTTrainer: topkd.hf.as_hf_dataset of one), "
        "whose items are exactly these"
    )
    if not isinstance(sample, dict):
        raise ValueError(
            f"collate: sample {i}: expected a dict of tensors (a TopKDataset item), got "
            f"{type(sample).__name__}; {hint}"
        )
    missing = [k for k in SAMPLE_KEYS if k not in sample]
    # without position_ids, attention would run across the documents packed into a sample
    if missing:
        raise ValueError(
            f"collate: sample {i}: expected the keys {list(SAMPLE_KEYS)}, got none of {missing} (keys "
            f"{sorted(sample)}); position_ids restart at each document, keeping attention inside it; "
            + hint
        )
    loose = [k for k, v in sample.items() if not isinstance(v, torch.Tensor)]
    if loose:
        kinds = ", ".join(f"{k}: {type(sample[k]).__name__}" for k in loose)
        raise ValueError(f"collate: sample {i}: expected torch tensors, got {kinds}; {hint}")


def logz_column(source: SequenceSource, temperature: float | None) -> int | None:
    """The source's column of c_T for a temperature (None: not needed). Refuses one the cache did not store."""
    if temperature is None:
        return None
    temps = [float(t) for t in source.temperatures]
    if float(temperature) not in temps:
        raise ValueError(
            f"temperature {temperature} with tail='bucket' needs c_T stored in the cache, which has "
            f"temperatures {temps}; rebuild the cache with --temperatures {temperature:g}, or use "
            "--tail renorm"
        )
    return temps.index(float(temperature))


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
    out["kd_mask"][n:] = False  # padded rows are masked; distinct ids keep them well-formed anyway
    out["teacher_ids"][n:] = torch.arange(out["teacher_ids"].shape[1])
    out["teacher_logprobs"][n:] = -30.0
    return out


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["kd_mask"].sum())
