"""Read a top-K cache: `TopKCache(path)[i]` decodes sequence i to torch tensors.

    cache = topkd.cache.TopKCache("runs/cache")
    row = cache[0]      # input_ids [L], teacher_ids [L, K], teacher_logprobs [L, K], log_tail [L], logz [L, nT], ...
    cache.check_student(vocab_size=model.config.vocab_size, tokenizer=tok)

Opening validates the manifest and every shard's size and header (cheap); `verify()` checks
every checksum. Shards are memory-mapped lazily and re-opened after a fork, so the cache can be
handed to DataLoader workers as it is.
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict

import numpy as np
import torch
from safetensors import SafetensorError

from topkd.cache.building.compat import (
    check_student_fits,
    load_teacher_tokenizer,
    tokenizer_problems,
)
from topkd.cache.format import manifest as mf
from topkd.cache.format.shard import (
    ShardReader,
    TeacherSequence,
    expected_tensors,
    read_row_counts,
    sequence_max_id,
)
from topkd.cache.format.targets import TargetKind, kind_of_manifest
from topkd.cache.format.text import TEXT_VERSION

OPEN_SHARDS = 64
# one row per token
ROW_TENSORS = {
    "input_ids",
    "log_mass",
    "log_tail",
    "logz",
    "log_mass_t",
    "lp_scale",
    "lp_codes",
    "id_rem",
    "ids_packed",
    "row_mask",
    "char_len",
}


class TopKCache:
    """A built cache. verify_reads: check a shard's sha256 the first time each process reads from it
    (about 50 ms per 32 MB shard), so a corrupted byte is refused, never decoded into wrong rows."""

    def __init__(self, path: str, verify_reads: bool = True):
        self.path, self.verify_reads = path, verify_reads
        self._verified: set[tuple[int, int]] = set()
        self.manifest = mf.load_manifest(path)
        self.fingerprint = self.manifest["fingerprint"]
        self.vocab_size, self.k = int(self.fingerprint["vocab_size"]), int(self.fingerprint["k"])
        self.temperatures = list(self.fingerprint["temperatures"])
        shards = self.manifest["shards"]
        self._first = [s["sequences"][0] for s in shards]
        self._len = shards[-1]["sequences"][1] if shards else 0
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        for j, side in enumerate(shards):
            problem = mf.check_shard(path, side, checksum=False)
            if problem:
                raise mf.CacheError(
                    f"cache {path}: {problem}; run `topkd cache verify {path}`, then rebuild "
                    "(rerunning the build command redoes only the bad shards once they are deleted)"
                )
            self._check_header(j, side)

    @property
    def targets(self) -> str:
        """The name of the kind of target its rows hold (topkd/cache/format/targets.py): topk, sampled or topp."""
        return self.target_kind.name

    @property
    def target_kind(self) -> TargetKind:
        """What its rows hold and allow (topkd/cache/format/targets.py)."""
        return kind_of_manifest(self.manifest["build"])

    @property
    def has_text(self) -> bool:
        """Whether every shard records its sequences' text and token spans (format version 6): what a student of
        another tokenizer needs (topkd train --cross-tokenizer)."""
        shards = self.manifest["shards"]
        return bool(shards) and all(s["format_version"] == TEXT_VERSION for s in shards)

    @property
    def teacher_dir(self) -> str:
        """Where the teacher that built this cache was loaded from (its fingerprint)."""
        return self.fingerprint["teacher"]

    def load_teacher(self):
        """The teacher that built this cache, loaded from its recorded path (what --init-from-teacher copies),
        in the dtype it was built with, and only if its weights, config and tokenizer still hash as the
        fingerprint says: a teacher directory overwritten after the build (a re-download into the same folder)
        is refused, never copied into a student."""
        from topkd.cache.building.teacher import identity_problem, load_teacher

        teacher = load_teacher(self.teacher_dir, str(self.fingerprint.get("dtype", "float32")))
        problem = identity_problem(teacher, self.fingerprint)
        if problem:
            raise mf.CacheError(
                f"cache {self.path}: the teacher at {self.teacher_dir} is not the one that built it "
                f"({problem}); restore that checkpoint there, or rebuild the cache from this teacher"
            )
        return teacher

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> int:
        return int(self.manifest["totals"]["tokens"])

    def shard(self, j: int) -> ShardReader:
        """Shard j's reader; at most OPEN_SHARDS stay open (a large cache has more shards than file handles)."""
        if j in self._readers:
            self._readers.move_to_end(j)
        else:
            self._readers[j] = ShardReader(
                os.path.join(self.path, self.manifest["shards"][j]["file"])
            )
            while len(self._readers) > OPEN_SHARDS:
                self._readers.popitem(last=False)
        return self._readers[j]

    def _check_header(self, j: int, side: dict) -> None:
        try:
            shard = self.shard(j)
        except (SafetensorError, OSError, ValueError) as e:
            # the header is read before any checksum (a checksum per open would cost every run seconds);
            # when it fails, the checksum says whether the bytes were damaged or written so
            damage = mf.check_shard(self.path, side)
            raise mf.CacheError(
                f"cache {self.path}: {side['file']} has an unreadable header ("
                f"{' '.join(str(e).split())}){'; ' + damage if damage else ''}; the shard is corrupt: "
                "delete it and its .json sidecar, and rerun the build command (it redoes only that shard)"
            )
        problem = mf.identity_problem(shard.meta, side, self.manifest["build_hash"])
        if problem or shard.temperatures != [float(t) for t in self.temperatures]:
            raise mf.CacheError(
                f"cache {self.path}: {problem or side['file'] + ': stored temperatures differ'}; "
                "it does not belong here: delete it and its .json sidecar and rerun the build "
                "command to redo it"
            )
        expected = expected_tensors(shard.meta, shard.id_codec.tensors)
        n_seq = side["sequences"][1] - side["sequences"][0]
        if (
            shard.names != expected
            or len(shard) != n_seq
            or shard.k != self.k
            or int(shard.meta.get("vocab", -1)) != self.vocab_size
        ):
            raise mf.CacheError(
                f"cache {self.path}: {side['file']} does not match the manifest (tensors "
                f"{sorted(shard.names)}, {len(shard)} sequences, K={shard.k}; expected "
                f"{sorted(expected)}, {n_seq} sequences, K={self.k}); rebuild it"
            )
        rows = {name: shard.shape(name)[0] for name in ROW_TENSORS & shard.names}
        if int(shard.seq_rows[-1]) != side["tokens"] or any(
            r != side["tokens"] for r in rows.values()
        ):
            raise mf.CacheError(
                f"cache {self.path}: {side['file']} rows {rows} (seq_rows end "
                f"{int(shard.seq_rows[-1])}) do not match the sidecar's {side['tokens']} tokens; "
                "rebuild it"
            )

    def locate(self, i: int) -> tuple[int, int]:
        if not -self._len <= i < self._len:
            raise IndexError(
                f"sequence index {i} out of range for a cache of {self._len} sequences"
            )
        i %= self._len
        j = bisect.bisect_right(self._first, i) - 1
        return j, i - self._first[j]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        seq = self.sequence(i)
        return {
            "input_ids": torch.from_numpy(seq.input_ids),
            "teacher_ids": torch.from_numpy(seq.ids),
            "teacher_logprobs": torch.from_numpy(seq.logprobs),
            "log_tail": torch.from_numpy(seq.log_tail),
            "log_mass": torch.from_numpy(seq.log_mass),
            "logz": torch.from_numpy(seq.logz),
            "doc_starts": torch.from_numpy(seq.doc_starts.astype(np.int64)),
            "source_index": seq.source_index,
            "token_offset": seq.token_offset,
            **({} if seq.row_mask is None else {"row_mask": torch.from_numpy(seq.row_mask)}),
        }

    def sequence(self, i: int) -> TeacherSequence:
        """Sequence i as its shard decodes it (numpy arrays, with its text in version 6), checked as [i] is."""
        j, local = self.locate(i)
        if self.verify_reads and (os.getpid(), j) not in self._verified:
            problem = mf.check_shard(
                self.path, self.manifest["shards"][j]
            ) or self._counted_problem(j)
            if problem:
                raise mf.CacheError(
                    f"cache {self.path}: {problem}; delete that shard and its .json sidecar and "
                    "rerun the build command to redo it"
                )
            self._verified.add((os.getpid(), j))
        seq = self.shard(j).sequence(local)
        self._check_max_id(j, i, seq)
        return seq

    def _check_max_id(self, j: int, i: int, seq) -> None:
        """The sidecar's max_id decides which student heads may read this cache (check_student): no row may
        hold an id past it, or a smaller head would index out of range."""
        side = self.manifest["shards"][j]
        recorded = side.get("max_id")
        if recorded is not None and (seen := sequence_max_id(seq)) > recorded:
            raise mf.CacheError(
                f"cache {self.path}: {side['file']} sequence {i} holds token id {seen}, past the max_id "
                f"{recorded} its sidecar and the manifest record; the sidecar or the shard was rewritten: "
                "delete that shard and its .json sidecar and rerun the build command to redo it"
            )

    def __getstate__(self):  # pickled into DataLoader workers: shard handles are re-opened there
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()
        return state

    def verify(self, progress: bool = False) -> list[str]:
        """Every shard's size and sha256 against its sidecar, its counted rows against the sidecar's, and the
        stored tokenizer's files against the manifest; returns the problems (empty: all good)."""
        from tqdm import tqdm

        shards = self.manifest["shards"]
        problems = [
            mf.check_shard(self.path, s) or self._counted_problem(j)
            for j, s in enumerate(tqdm(shards, desc="verify", unit="shard", disable=not progress))
        ]
        return [p for p in problems if p] + tokenizer_problems(self.path, self.manifest)

    def _counted_problem(self, j: int) -> str | None:
        """A shard's row_mask must count the rows its sidecar recorded (a rewritten mask with fixed checksums)."""
        side = self.manifest["shards"][j]
        _, counted = read_row_counts(os.path.join(self.path, side["file"]))
        if counted != side.get("counted", counted):
            return f"{side['file']}: its row_mask counts {counted} rows, the sidecar recorded {side['counted']}"
        return None

    @property
    def seq_len(self) -> int:
        return int(self.manifest["build"]["seq_len"])

    @property
    def separator(self) -> int | None:
        return self.manifest["build"].get("separator")

    def sequence_lengths(self) -> list[int]:
        """Tokens of each cached sequence, from the shard headers, without decoding anything."""
        lengths = []
        for j in range(len(self.manifest["shards"])):
            lengths.extend(np.diff(self.shard(j).seq_rows).tolist())
        return lengths

    def document_starts(self) -> list[np.ndarray]:
        """Where documents begin in each cached sequence (row 0 always counts), from the shard headers."""
        starts = []
        for j in range(len(self.manifest["shards"])):
            shard = self.shard(j)
            rows, docs = shard.seq_rows, shard.doc_starts
            for a, e in zip(rows[:-1], rows[1:]):
                starts.append(np.union1d([0], docs[(docs >= a) & (docs < e)] - a).astype(np.int64))
        return starts

    @property
    def counted_tokens(self) -> int:
        """Rows that count for KD and CE (chat data: assistant targets; otherwise every row)."""
        return sum(side.get("counted", side["tokens"]) for side in self.manifest["shards"])

    @property
    def max_id(self) -> int | None:
        """The largest token id the rows hold (None for caches built before it was recorded)."""
        ids = [side.get("max_id") for side in self.manifest["shards"]]
        return None if not ids or None in ids else max(ids)

    def check_student(self, vocab_size: int, tokenizer=None) -> None:
        """Refuse a student whose head cannot hold the cache's ids or whose tokenizer gives other ids (compat)."""
        teacher_tokenizer = (
            None if tokenizer is None else load_teacher_tokenizer(self.path, self.manifest)
        )
        check_student_fits(
            self.vocab_size,
            self.fingerprint["tokenizer_sha256"],
            vocab_size,
            tokenizer,
            teacher_tokenizer,
            self.max_id,
        )
