"""--cross-tokenizer uld|align: a student whose tokenizer is not the teacher's, trained from a cache with text.

    source = CrossTokenizerSource(TopKCache(path), student_tokenizer, "align")   # a SequenceSource
    loss = cross_batch_loss(hidden, weight, batch, ce_weight)                    # from train.student.batch_loss

The source re-tokenises each cached sequence's text with the student's tokenizer and aligns the two by
character spans (topkd.data.align). Its items are per student row, so SampleStream slices, packs and pads them
as any source's: `kd_mask` marks the student rows of counted text, and three more keys say what each row
trains with (samples.EXTRA_ROW_KEYS): `cross_kind` (0: CE only, 1: exact KD, 2: ULD), `chain_len` (a ULD row's
group has this many more student tokens, the rows after it) and `uld_rest` (the teacher's rest bucket). An
exact row's teacher_ids are the teacher's top-K mapped to same-string student ids (the others left out, so
their mass joins the tail bucket); a ULD row's teacher_logprobs are the teacher's probabilities, chain-scaled
and sorted (ids unused). `uld` mode makes every aligned row a ULD row; `align` uses exact KD where it can.
A teacher group whose chain tokens are not all in its cached rows cannot be scaled: its row trains CE only.
"""

from __future__ import annotations

import numpy as np
import torch

from topkd.cache import TopKCache
from topkd.cache.building.compat import load_teacher_tokenizer
from topkd.data.align import AlignedSequence, VocabMap, align_sequence
from topkd.loss.cross import CrossTargets, cross_tokenizer_kd

CROSS_MODES = ("uld", "align")
CE_ONLY, EXACT, ULD = 0, 1, 2


class CrossTokenizerSource:
    """A TopKCache read through a student's tokenizer (module docstring): a SequenceSource in student tokens."""

    def __init__(self, cache: TopKCache, student_tokenizer, mode: str):
        if mode not in CROSS_MODES:
            raise ValueError(f"cross_tokenizer: expected one of {CROSS_MODES}, got {mode!r}")
        if not cache.has_text:
            raise ValueError(
                f"cache {cache.path}: expected the text of its sequences (format version 6), got a cache "
                f"without it (version {cache.manifest['format_version']}); a student of another tokenizer "
                "re-tokenises that text: rebuild the cache with this topkd (same command, a new --out)"
            )
        self.cache, self.tokenizer, self.mode = cache, student_tokenizer, mode
        self.teacher_tokenizer = load_teacher_tokenizer(cache.path, cache.manifest)
        if self.teacher_tokenizer is None:
            raise ValueError(
                f"cache {cache.path}: expected the teacher's tokenizer (its tokenizer/ copy, or the teacher "
                f"directory {cache.teacher_dir}), got neither; the alignment maps its ids to the student's"
            )
        self.vocab = VocabMap.between(self.teacher_tokenizer, student_tokenizer, cache.vocab_size)
        self.path, self.k = cache.path, cache.k
        self.vocab_size = len(student_tokenizer)
        self.temperatures: list[float] = []
        self.separator = student_tokenizer.eos_token_id
        self.targets, self.target_kind = cache.targets, cache.target_kind
        self.teacher_dir = cache.teacher_dir
        self.teacher_separator = self.teacher_tokenizer.eos_token_id
        # lengths and document starts (every text re-tokenised once here; the rows are decoded again per item)
        aligned = [self._aligned(cache.sequence(i)) for i in range(len(cache))]
        self._shapes = [(len(a.input_ids), a.doc_starts) for a in aligned]
        self.tokens = sum(n for n, _ in self._shapes)
        self.counted_tokens = self.tokens if cache.counted_tokens else 0
        self.seq_len = max((n for n, _ in self._shapes), default=0)

    def __len__(self) -> int:
        return len(self.cache)

    def sequence_lengths(self) -> list[int]:
        return [n for n, _ in self._shapes]

    def document_starts(self) -> list[np.ndarray]:
        return [starts for _, starts in self._shapes]

    def load_teacher(self):
        return self.cache.load_teacher()

    def check_student(self, vocab_size: int, tokenizer=None) -> None:
        """The student's head covers its tokenizer, and its tokenizer spells the cached text back (a normaliser
        that drops or rewrites characters would train it on another text); chat text only with the teacher's
        turn markers among its own special tokens."""
        if vocab_size < len(self.tokenizer):
            raise ValueError(
                f"student: expected a head of at least its tokenizer's {len(self.tokenizer)} ids, got "
                f"{vocab_size} rows; pass the student's own tokenizer"
            )
        check_spelling(self.cache, self.tokenizer)
        check_chat_markers(self.cache, self.teacher_tokenizer, self.tokenizer)

    def _aligned(self, seq) -> AlignedSequence:
        return align_sequence(
            seq.text,
            seq.char_len,
            seq.input_ids,
            seq.doc_starts,
            self.tokenizer,
            self.vocab,
            self.teacher_separator,
        )

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = self.cache.sequence(i)
        aligned = self._aligned(seq)
        rows = student_rows(seq, aligned, self.vocab, self.mode, self.k)
        return {name: torch.from_numpy(value) for name, value in rows.items()}


def student_rows(seq, aligned: AlignedSequence, vocab: VocabMap, mode: str, k: int) -> dict:
    """The item of one cached sequence in student rows (module docstring), computed from its teacher rows."""
    n = len(aligned.input_ids)
    ids, logprobs = np.tile(np.arange(k), (n, 1)), np.full((n, k), -30.0, np.float32)
    kind, chain_len = np.zeros(n, np.int8), np.zeros(n, np.int64)
    rest, counted = np.zeros(n, np.float32), np.zeros(n, bool)
    t_rows, t_tokens, t_groups = aligned.teacher_chain
    s_rows, s_groups = aligned.student_chain
    groups = np.arange(len(aligned.teacher_row) + 1)
    # chains are listed in group order: group g's are one slice of each
    t_cut, s_cut = np.searchsorted(t_groups, groups), np.searchsorted(s_groups, groups)
    for g in range(len(aligned.teacher_row)):
        r, s = int(aligned.teacher_row[g]), int(aligned.student_row[g])
        chain = s_rows[s_cut[g] : s_cut[g + 1]]
        t_chain = slice(t_cut[g], t_cut[g + 1])
        if seq.row_mask is not None and not seq.row_mask[r]:
            continue  # context the teacher read, no target
        counted[s : s + 1 + len(chain)] = True
        if mode == "align" and aligned.exact[g]:
            mapped = _mapped_row(seq.ids[r], seq.logprobs[r], vocab)
            if mapped is not None:
                ids[s], logprobs[s], kind[s] = mapped[0], mapped[1], EXACT
                continue
        scaled = _chain_scaled(
            seq, r, int(aligned.teacher_first[g]), t_rows[t_chain], t_tokens[t_chain]
        )
        if scaled is not None:
            logprobs[s], kind[s], chain_len[s] = scaled, ULD, len(chain)
            rest[s] = np.exp(np.float64(seq.log_tail[r]))
    return {
        "input_ids": aligned.input_ids,
        "teacher_ids": ids,
        "teacher_logprobs": logprobs,
        "log_tail": np.zeros(n, np.float32),
        "log_mass": np.zeros(n, np.float32),
        "logz": np.zeros((n, 0), np.float32),
        "doc_starts": aligned.doc_starts,
        "row_mask": counted,
        "cross_kind": kind,
        "chain_len": chain_len,
        "uld_rest": rest,
    }


def _mapped_row(ids: np.ndarray, logprobs: np.ndarray, vocab: VocabMap):
    """A teacher row in student ids: entries without a same-string student token left out (padding -inf, the
    first mapped id), so their mass is the tail bucket's; None when no entry maps."""
    mapped = vocab.to_student[ids]
    keep = (mapped >= 0) & np.isfinite(logprobs)
    if not keep.any():
        return None
    order = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)])
    out_ids = np.where(keep, mapped, mapped[keep][0])[order]
    return out_ids, np.where(keep, logprobs, -np.inf)[order].astype(np.float32)


def _chain_scaled(seq, row: int, first: int, chain_rows, chain_tokens):
    """log of teacher row `row`'s probabilities with its first token's times the chain's, sorted descending
    (-inf past the real entries); None when a chain token (or, with a chain, the first) is not in the cache."""
    lp = seq.logprobs[row].astype(np.float64)
    delta = 0.0
    for r, t in zip(chain_rows, chain_tokens):
        hit = np.flatnonzero((seq.ids[r] == t) & np.isfinite(seq.logprobs[r]))
        if not hit.size:
            return None
        delta += float(seq.logprobs[r][hit[0]])
    if len(chain_rows):
        hit = np.flatnonzero((seq.ids[row] == first) & np.isfinite(lp))
        if not hit.size:
            return None
        lp = lp.copy()
        lp[hit[0]] += delta
    return -np.sort(-lp).astype(np.float32)


def cross_batch_loss(hidden, weight, batch: dict, ce_weight: float) -> torch.Tensor:
    """The summed cross-tokenizer loss of a batch of CrossTokenizerSource samples (topkd.loss.cross)."""
    loss, _ = cross_tokenizer_kd(hidden, weight, batch_targets(batch), ce_weight=ce_weight)
    return loss


def batch_targets(batch: dict) -> CrossTargets:
    """CrossTargets over the flattened [B * L] rows; a ULD row whose chain a sample cut or padding broke (a
    chain row without its label, or past its sample's end) trains CE only."""
    length = batch["input_ids"].shape[1]
    kind, labels = batch["cross_kind"].reshape(-1), batch["labels"].reshape(-1)
    live = batch["kd_mask"].reshape(-1) & (labels != -100)
    ids = batch["teacher_ids"].reshape(-1, batch["teacher_ids"].shape[-1])
    logprobs = batch["teacher_logprobs"].reshape(ids.shape)
    exact = torch.nonzero(live & (kind == EXACT))[:, 0]
    uld = torch.nonzero(live & (kind == ULD))[:, 0]
    n = batch["chain_len"].reshape(-1)[uld]
    group = torch.repeat_interleave(torch.arange(len(uld)), n)
    start = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    rows = uld[group] + 1 + torch.arange(len(group)) - start
    inside = rows % length > uld[group] % length  # no wrap into the next sample
    rows = torch.where(inside, rows, 0)
    broken = group[~(inside & (labels[rows] != -100))]
    whole = torch.ones(len(uld), dtype=torch.bool)
    whole[broken] = False
    keep_chain = whole[group]
    renumber = torch.cumsum(whole, 0) - 1
    uld, chain_rows = uld[whole], rows[keep_chain]
    teacher = logprobs[uld].exp()
    return CrossTargets(
        exact_rows=exact,
        exact_ids=ids[exact],
        exact_logprobs=logprobs[exact],
        uld_rows=uld,
        uld_first=labels[uld],
        uld_teacher=teacher,
        uld_width=torch.isfinite(logprobs[uld]).sum(1),
        uld_rest=batch["uld_rest"].reshape(-1)[uld],
        chain_rows=chain_rows,
        chain_tokens=labels[chain_rows],
        chain_group=renumber[group[keep_chain]],
        ce_rows=torch.nonzero(live)[:, 0],
        ce_labels=labels[live],
    )


def check_cross_config(cfg) -> None:
    """--cross-tokenizer's flags: a --cache with text and a --student of its own, offline, plain bucket KL at T = 1
    (before anything loads)."""
    if not cfg.cross_tokenizer:
        return
    if cfg.cross_tokenizer not in CROSS_MODES:
        raise ValueError(
            f"--cross-tokenizer: expected one of {CROSS_MODES}, got {cfg.cross_tokenizer!r}"
        )
    clashes = {
        "--cache": not cfg.cache,
        "--student": not cfg.student or cfg.init_from_teacher,
        "no --teacher / --teacher-url / --on-policy": bool(
            cfg.teacher or cfg.teacher_url or cfg.on_policy
        ),
        "--divergence kl": cfg.divergence != "kl",
        "--temperature 1": cfg.temperature != 1.0,
        "no --top-k": bool(cfg.top_k),
        "no --fold-beyond-vocab": cfg.fold_beyond_vocab,
    }
    wrong = [flag for flag, bad in clashes.items() if bad]
    if wrong:
        raise ValueError(
            f"--cross-tokenizer {cfg.cross_tokenizer}: expected {', '.join(wrong)}; it trains a student of "
            "another tokenizer offline from a cache's text, with exact KL and ULD at T = 1"
        )


def check_spelling(cache: TopKCache, tokenizer, sequences: int = 32) -> None:
    """The student's tokens of the first cached texts decode to those texts; else one line at the first change."""
    for i in range(min(sequences, len(cache))):
        text = cache.sequence(i).text
        back = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"])
        if back != text:
            at = next(
                (j for j, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back))
            )
            raise ValueError(
                f"student tokenizer: expected it to spell the cached text back, got a change in sequence {i} at "
                f"character {at}: {text[max(0, at - 12) : at + 12]!r} -> {back[max(0, at - 12) : at + 12]!r} "
                "(its normaliser rewrites or drops characters); pick a student whose tokenizer keeps the text"
            )


def check_chat_markers(cache: TopKCache, teacher_tokenizer, tokenizer) -> None:
    """Chat text rendered with the teacher's template carries its turn markers (special tokens of the teacher's):
    the student must have them as tokens of its own, or it would learn them as plain characters and its own
    template's never. The separator owns no text, so plain text passes."""
    ours = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    text = "".join(cache.sequence(i).text for i in range(min(8, len(cache))))
    missing = [t for t in teacher_tokenizer.all_special_tokens if t in text and t not in ours]
    if missing:
        raise ValueError(
            f"cache {cache.path}: chat text rendered with the teacher's template, whose markers {missing[:4]} "
            "the student's tokenizer does not have as tokens (a chat template mismatch); train on plain "
            "text, or pick a student whose tokenizer and template use the same markers"
        )
