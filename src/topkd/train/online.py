"""Online distillation: the teacher runs in memory for every sequence instead of being read from a cache.

    source = OnlineTeacher(load_teacher("teacher_dir"), ["a.txt"], seq_len=512, k=0)   # k=0: full vocabulary
    SampleStream(source, 512, seed=0)     # the same stream, student and loss as offline training

This is the paper's "online" row, and lets a user check offline against online on their own
data. Sequences are packed exactly as `topkd cache build` packs them (same files, --seq-len and
separator give the same sequences and the same sample order), and the teacher sees the same
per-document context, so with k equal to the cache's K the only difference from offline
training is the cache's log-prob quantisation. k=0 keeps the full distribution: teacher ids
0..V-1 on every row, which costs [tokens, V] memory, as online KD does.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import torch

from topkd.cache.building.compat import check_student_fits
from topkd.cache.building.teacher import Teacher, tokenizer_hash
from topkd.cache.format.engine_rows import EngineRows
from topkd.cache.format.sampled import Sampler
from topkd.cache.format.targets import SAMPLED, TOPK, TargetKind
from topkd.data.documents import iter_documents, pack_sequences, position_ids
from topkd.models import model_head, soft_cap


class OnlineTeacher:
    """A sequence source (like TopKCache) whose teacher rows are computed when a sequence is read."""

    def __init__(
        self,
        teacher: Teacher,
        data: list[str],
        seq_len: int,
        k: int,
        temperatures: list[float],
        text_field: str = "text",
        max_sequences: int = 0,
        messages_field: str = "messages",
        train_on: str = "assistant",
        samples: int = 0,
    ):
        if not 0 <= k <= teacher.vocab:
            raise ValueError(
                f"online_k: expected 0 (full vocabulary) or 1..{teacher.vocab}, got {k}"
            )
        self.teacher, self.seq_len, self.k, self.temperatures = (
            teacher,
            seq_len,
            k,
            list(temperatures),
        )
        self.samples = samples  # > 0: sampled targets, that many draws a token (k is then 0)
        self.separator = teacher.tokenizer.eos_token_id
        self.vocab_size = teacher.vocab
        documents = iter_documents(
            data,
            teacher.tokenizer,
            text_field,
            vocab=teacher.vocab,
            messages_field=messages_field,
            train_on=train_on,
        )
        self.sequences = list(
            itertools.islice(
                pack_sequences(documents, seq_len, self.separator), max_sequences or None
            )
        )
        if not self.sequences:
            raise ValueError(f"data: expected text to train on, got no tokens from {data}")

    def __len__(self) -> int:
        return len(self.sequences)

    def sequence_lengths(self) -> list[int]:
        return [len(s.tokens) for s in self.sequences]

    def document_starts(self) -> list[np.ndarray]:
        return [np.union1d([0], s.doc_starts).astype(np.int64) for s in self.sequences]

    def check_student(self, vocab_size: int, tokenizer=None) -> None:
        check_student_fits(
            self.vocab_size,
            tokenizer_hash(self.teacher.tokenizer),
            vocab_size,
            tokenizer,
            self.teacher.tokenizer,
        )

    @property
    def teacher_dir(self) -> str:
        return self.teacher.source

    @property
    def path(self) -> str:
        return self.teacher.source  # no cache: the rows come from the teacher itself

    @property
    def targets(self) -> str:
        return self.target_kind.name

    @property
    def target_kind(self) -> TargetKind:
        # the teacher's top k exactly (k = 0: top-V, the whole distribution), or its draws
        return SAMPLED if self.samples else TOPK

    @property
    def tokens(self) -> int:
        return sum(self.sequence_lengths())

    @property
    def counted_tokens(self) -> int:
        return sum(
            len(s.tokens) if s.row_mask is None else int(s.row_mask.sum()) for s in self.sequences
        )

    def load_teacher(self) -> Teacher:
        """The teacher (already in memory here): what --init-from-teacher copies layers from."""
        return self.teacher

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = self.sequences[i]
        rows = self.rows([seq])[0]
        # chat: as the cache; rows a served teacher could not score (topkd/cache/building/served.py) never count
        row_mask = seq.row_mask
        if rows.scored is not None and not rows.scored.all():
            row_mask = rows.scored if row_mask is None else row_mask & rows.scored
        mask = {} if row_mask is None else {"row_mask": torch.from_numpy(row_mask)}
        return {
            "input_ids": torch.from_numpy(np.asarray(seq.tokens, dtype=np.int64)),
            "teacher_ids": torch.as_tensor(rows.ids),
            "teacher_logprobs": torch.as_tensor(rows.logprobs),
            "logz": torch.as_tensor(rows.logz),
            "doc_starts": torch.from_numpy(seq.doc_starts.astype(np.int64)),
            **mask,
        }

    def rows(self, sequences: list) -> list[EngineRows]:
        """The teacher's rows of packed sequences (topkd.data.documents.Sequence): its top k through the
        TeacherEngine interface, as the cache build takes them (equal lengths in one batch), or k = 0 the whole
        distribution."""
        temps = tuple(self.temperatures)
        if self.samples:
            return self.teacher.sequence_rows(
                sequences, self.samples, temps, len(sequences), sampler=self._sampler(sequences)
            )
        if self.k:
            return self.teacher.sequence_rows(sequences, self.k, temps, len(sequences))
        device = self.teacher.model.device
        out = []
        for seq in sequences:
            ids = torch.from_numpy(np.asarray(seq.tokens, dtype=np.int64))[None].to(device)
            pos = torch.from_numpy(position_ids(len(seq.tokens), seq.doc_starts))[None].to(device)
            out.append(self._full_rows(ids, pos, temps))
        return out

    def _sampler(self, sequences: list) -> Sampler:
        """Draws seeded by the tokens they score: a resumed run (or a rerun) draws the same targets."""
        tokens = b"".join(np.asarray(s.tokens, np.int64).tobytes() for s in sequences)
        seed = int.from_bytes(hashlib.sha256(tokens).digest()[:8], "little") >> 1
        generator = torch.Generator(device=self.teacher.model.device).manual_seed(seed)
        return Sampler(generator, self.samples)

    @torch.no_grad()  # not inference_mode: these rows go into the autograd graph of the student's loss
    def _full_rows(
        self, ids: torch.Tensor, pos: torch.Tensor, temps: tuple[float, ...]
    ) -> EngineRows:
        """log softmax over the whole vocabulary (no tail); c_T = logsumexp(log p / T) per temperature."""
        h = self.teacher.hidden_states(ids, pos)[0].float()
        weight, bias = self.teacher.head_fp32
        z = soft_cap(torch.nn.functional.linear(h, weight, bias), model_head(self.teacher.model)[2])
        logprobs = torch.log_softmax(z, dim=-1)
        logz = (
            torch.stack([torch.logsumexp(logprobs / t, dim=-1) for t in temps], 1)
            if temps
            else torch.zeros(len(z), 0)
        )
        all_ids = torch.arange(self.vocab_size, dtype=torch.int32).expand(len(z), -1)
        n = len(z)
        return EngineRows(
            ids=all_ids.clone().numpy(),
            logprobs=logprobs.cpu().numpy(),
            log_mass=np.zeros(n, np.float32),
            log_tail=np.full(n, -np.inf, np.float32),
            logz=logz.cpu().numpy(),
        )
