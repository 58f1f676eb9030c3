"""On-policy distillation: the student writes the assistant turns, the teacher scores them, the fused loss trains.

    topkd train --on-policy --teacher TEACHER --data chats.jsonl --init-from-teacher --layers 4 \
        --online-k 100 --divergence reverse_kl --max-new-tokens 64 --seq-len 256 --out runs/on-policy

Each on-policy step takes batch_size prompts per micro-batch (topkd.data.prompts: a conversation up to an
assistant turn, in a seeded order, epoch after epoch), lets the student complete them (topkd.train.generate),
has the teacher read prompt + completion in memory (the OnlineTeacher's rows: its top --online-k, or the whole
vocabulary at 0) and takes the loss on the completion's rows only: row j, which predicts token j + 1, counts
when token j + 1 is one the student wrote. With --divergence reverse_kl that is the per-token reverse KL of the
teacher on the student's own samples (the on-policy distillation recipe, here exact over the teacher's rows and
its tail bucket instead of one sampled token); kl and jsd --beta are GKD's. --on-policy-fraction λ makes a step
on-policy with probability λ (seeded by the step: a resumed run makes the same choices) and otherwise takes the
offline batch (the teacher on the data's own replies, or with --cache beside --teacher the cache's next samples),
as GKD's lmbda; λ = 0 is online (or offline) training exactly.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from topkd.cache.building.served import ServedTeacher
from topkd.data.documents import Sequence
from topkd.data.prompts import chat_prompts, end_of_turn_ids
from topkd.data.samples import collate
from topkd.models.generate import GenerationSettings, generate
from topkd.train.online import OnlineTeacher


@dataclass
class OnPolicy:
    """Prompts and settings of on-policy steps; step_batches makes one step's micro-batches."""

    teacher: OnlineTeacher
    prompts: list[np.ndarray]
    settings: GenerationSettings
    fraction: float
    seed: int
    stop_ids: list[int]  # where a completion ends: EOS and the template's end of turn
    pad_id: int
    logz_column: int | None = None

    def chooses(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based) is on-policy: a pure function of (seed, step)."""
        if self.fraction >= 1 or self.fraction <= 0:
            return self.fraction >= 1
        return bool(np.random.default_rng([self.seed, step, 17]).random() < self.fraction)

    def prompt(self, index: int) -> np.ndarray:
        """Prompt `index` of the endless seeded order (each epoch a fresh permutation of all prompts)."""
        epoch, at = divmod(index, len(self.prompts))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
        return self.prompts[order[at]]

    def step_batches(
        self, model, first_prompt: int, step: int, micro: int, size: int, world: int, rank: int
    ):
        """This rank's `micro` micro-batches of `size` prompts each, completed by model and scored by the
        teacher, laid out as samples_per_step prompts from first_prompt on (as step_batches lays out samples);
        and what making them took."""
        stats = {
            "generate_s": 0.0,
            "score_s": 0.0,
            "generated_tokens": 0,
            "completions": 0,
            "unscored": 0,
        }
        # a served teacher answers over the network: score micro-batch m there while the student writes m + 1
        # (safe: the weights do not change within a step); a teacher in memory would share the cores instead
        pool = ThreadPoolExecutor(1) if self.served and micro > 1 else None
        scoring = []
        for m in range(micro):
            first = first_prompt + (m * world + rank) * size
            prompts = [self.prompt(i) for i in range(first, first + size)]
            start = time.perf_counter()
            completions = generate(
                model, prompts, self.settings, self._seed(step, m, rank), self.stop_ids, self.pad_id
            )
            stats["generate_s"] += time.perf_counter() - start
            stats["generated_tokens"] += sum(len(c) for c in completions)
            stats["completions"] += len(completions)
            job = partial(self._batch, prompts, completions)
            scoring.append(job() if pool is None else pool.submit(job))
        waited = time.perf_counter()
        if (
            pool is not None
        ):  # score_s: how long scoring kept the step waiting once the last turn was written
            with pool:
                scoring = [future.result() for future in scoring]
            stats["score_s"] += time.perf_counter() - waited
        else:
            stats["score_s"] += sum(seconds for _, _, seconds in scoring)
        stats["unscored"] += sum(unscored for _, unscored, _ in scoring)
        return [batch for batch, _, _ in scoring], stats

    @property
    def served(self) -> bool:
        return isinstance(self.teacher.teacher, ServedTeacher)

    def _batch(self, prompts: list[np.ndarray], completions: list[np.ndarray]):
        """(the collated batch, its completions not wholly scored, the seconds scoring took)."""
        start = time.perf_counter()
        items = self._items(prompts, completions)
        unscored = sum(not item.pop("scored") for item in items)
        return collate(items), unscored, time.perf_counter() - start

    def _seed(self, step: int, micro: int, rank: int) -> int:
        return int(np.random.default_rng([self.seed, step, micro, rank]).integers(2**31))

    def _items(self, prompts: list[np.ndarray], completions: list[np.ndarray]) -> list[dict]:
        """Prompt + completion as training samples, the teacher's rows on them, only the completion counted."""
        sequences = [
            Sequence(np.concatenate([p, c]), np.zeros(1, np.int64), i, 0)
            for i, (p, c) in enumerate(zip(prompts, completions))
        ]
        rows = self.teacher.rows(sequences)
        return [
            completion_item(seq.tokens, len(p), r, self.logz_column)
            for seq, p, r in zip(sequences, prompts, rows)
        ]


def completion_item(tokens: np.ndarray, prompt_len: int, rows, logz_column: int | None) -> dict:
    """One sample (a TopKDataset item's keys) whose counted rows are those predicting a completion token."""
    n = len(tokens)
    ids = torch.from_numpy(tokens.astype(np.int64))
    counted = torch.zeros(n, dtype=torch.bool)
    counted[prompt_len - 1 : n - 1] = True  # row j predicts token j + 1
    # rows a served teacher did not score (it read other tokens): none count
    if rows.scored is not None:
        counted &= torch.from_numpy(np.asarray(rows.scored, dtype=bool))
    labels = torch.full((n,), -100, dtype=torch.long)
    labels[prompt_len - 1 : n - 1] = torch.where(
        counted[prompt_len - 1 : n - 1], ids[prompt_len:], -100
    )
    item = {
        "input_ids": ids,
        "position_ids": torch.arange(n),
        "labels": labels,
        "kd_mask": counted,
        "teacher_ids": torch.as_tensor(rows.ids),
        "teacher_logprobs": torch.as_tensor(rows.logprobs),
        # whether the teacher scored every completion row; taken out by step_batches (not a batch key)
        "scored": rows.scored is None
        or bool(np.asarray(rows.scored)[prompt_len - 1 : n - 1].all()),
    }
    if logz_column is not None:
        item["teacher_logz"] = torch.as_tensor(rows.logz)[:, logz_column]
    return item


def open_on_policy(cfg, source: OnlineTeacher, logz_column: int | None) -> OnPolicy:
    """The run's on-policy side: its prompts (those that leave room for --max-new-tokens in --seq-len)."""
    tokenizer = source.teacher.tokenizer
    if cfg.max_new_tokens >= source.seq_len:
        raise ValueError(
            f"--max-new-tokens: expected fewer than the {source.seq_len} tokens of a sample (--seq-len, or the "
            f"cache's), got {cfg.max_new_tokens}; lower it, or raise --seq-len"
        )
    prompts = chat_prompts(
        cfg.data, tokenizer, source.seq_len - cfg.max_new_tokens, cfg.messages_field
    )
    settings = GenerationSettings(cfg.max_new_tokens, cfg.sampling_temperature, cfg.sampling_top_p)
    stop = end_of_turn_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    return OnPolicy(
        source, prompts, settings, cfg.on_policy_fraction, cfg.seed, stop, pad, logz_column
    )
