"""Cross-tokenizer alignment: a teacher-tokenised text re-tokenised by a student, the two matched by character spans.

    vocab = VocabMap.between(teacher_tokenizer, student_tokenizer)    # ids whose strings are identical
    aligned = align_sequence(text, char_len, teacher_ids, doc_starts, student_tokenizer, vocab)

Each document piece of the text is tokenised by the student alone (its own separator after it where the teacher
had one). Both tokenisations partition the text (topkd.data.spans); a group is a maximal run of teacher tokens
and student tokens covering the same characters: a cut falls wherever both have a token boundary, and a token
owning no characters belongs to the group before it. Group g (teacher tokens c..d, student a..b) is predicted
at teacher row c - 1 and student row a - 1, the rows whose next token is the group's first; the rest of its
tokens are the chain the chain rule multiplies in (teacher rows c..d - 1, student rows a..b - 1). A group is
`exact` when it is one token on each side and the two are the same string (VocabMap): its next-token
distributions can be compared id by id. The first group of a document has no prediction row and is left out;
a separator is its own group, matched to the student's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from topkd.data.spans import owned_lengths


@dataclass(frozen=True)
class VocabMap:
    """teacher id -> student id where the two tokens are the same string (-1: none); one to one."""

    to_student: np.ndarray  # [V_teacher] int64

    @staticmethod
    def between(teacher, student, teacher_vocab: int = 0) -> VocabMap:
        """Token strings read in context (after a plain prefix, so a SentencePiece word's leading space counts);
        strings two ids share on one side, or holding a partial character, map to nothing. teacher_vocab: the
        teacher head's rows, when more than its tokenizer's ids (padding rows map to nothing)."""
        t, s = token_strings(teacher), token_strings(student)
        owners: dict[str, int] = {}
        for i, text in enumerate(s):
            owners[text] = -1 if text in owners else i  # -1: ambiguous, never mapped
        to_student = np.full(max(len(t), teacher_vocab), -1, np.int64)
        seen = Counter(t)
        for i, text in enumerate(t):
            if text and "\ufffd" not in text and seen[text] == 1 and owners.get(text, -1) >= 0:
                to_student[i] = owners[text]
        if teacher.eos_token_id is not None and student.eos_token_id is not None:
            # the separators: one group, whatever their spelling
            to_student[teacher.eos_token_id] = student.eos_token_id
        return VocabMap(to_student)


def token_strings(tokenizer) -> list[str]:
    """Every id's string as it reads after a prefix (special tokens: their content)."""
    prefix = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(tokenizer)
    head = tokenizer.decode(prefix)
    pairs = tokenizer.batch_decode([prefix + [i] for i in range(n)])
    return [p[len(head) :] if p.startswith(head) else "\ufffd" for p in pairs]


@dataclass
class AlignedSequence:
    """A cached sequence as the student reads it, and its groups (module docstring), rows in each coordinate."""

    input_ids: np.ndarray  # [Ls] the student's tokens
    doc_starts: np.ndarray  # student rows where a document begins
    teacher_row: np.ndarray  # [G] the teacher row predicting group g (c - 1)
    student_row: np.ndarray  # [G] the student row predicting it (a - 1)
    teacher_first: np.ndarray  # [G] teacher token c
    student_first: np.ndarray  # [G] student token a
    exact: np.ndarray  # [G] bool: one same-string token on each side
    teacher_chain: tuple[
        np.ndarray, np.ndarray, np.ndarray
    ]  # (row j - 1, token j, group) for j in c+1..d
    student_chain: tuple[
        np.ndarray, np.ndarray
    ]  # (row i - 1, group) for student tokens i in a+1..b


def align_sequence(
    text: str,
    char_len: np.ndarray,
    teacher_ids: np.ndarray,
    doc_starts: np.ndarray,
    student,
    vocab: VocabMap,
    teacher_separator: int | None,
) -> AlignedSequence:
    """Re-tokenise a cached sequence (its text, owned lengths, teacher ids, document starts) for the student."""
    ends = np.concatenate([[0], np.cumsum(char_len)])
    bounds = sorted({0, *np.asarray(doc_starts).tolist()}) + [len(teacher_ids)]
    ids: list[np.ndarray] = []
    groups: list[tuple] = []
    t_chain: list[tuple[int, int, int]] = []
    s_chain: list[tuple[int, int]] = []
    starts = []
    for r0, r1 in ((a, e) for a, e in zip(bounds[:-1], bounds[1:]) if e > a):
        sep = teacher_separator is not None and teacher_ids[r1 - 1] == teacher_separator
        text_end = r1 - 1 if sep else r1
        s_ids, pairs = _piece(text[ends[r0] : ends[text_end]], char_len[r0:text_end], student, sep)
        s0 = sum(len(x) for x in ids)
        starts.append(s0)
        ids.append(s_ids)
        for (c, d), (a, b) in pairs[1:]:  # the first group of a document: no row predicts it
            g = len(groups)
            t_tok, s_tok = int(teacher_ids[r0 + c]), int(s_ids[a])
            one = c == d and a == b and vocab.to_student[t_tok] == s_tok
            groups.append((r0 + c - 1, s0 + a - 1, t_tok, s_tok, one))
            t_chain += [(r0 + j - 1, int(teacher_ids[r0 + j]), g) for j in range(c + 1, d + 1)]
            s_chain += [(s0 + i - 1, g) for i in range(a + 1, b + 1)]
    cols = list(zip(*groups)) if groups else [()] * 5
    tc = np.asarray(t_chain, np.int64).reshape(-1, 3)
    sc = np.asarray(s_chain, np.int64).reshape(-1, 2)
    return AlignedSequence(
        input_ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
        doc_starts=np.asarray(starts, np.int64),
        teacher_row=np.asarray(cols[0], np.int64),
        student_row=np.asarray(cols[1], np.int64),
        teacher_first=np.asarray(cols[2], np.int64),
        student_first=np.asarray(cols[3], np.int64),
        exact=np.asarray(cols[4], bool),
        teacher_chain=(tc[:, 0], tc[:, 1], tc[:, 2]),
        student_chain=(sc[:, 0], sc[:, 1]),
    )


def _piece(piece: str, teacher_len: np.ndarray, student, separator: bool):
    """One document piece: the student's ids (its separator after them where the teacher had one) and the
    groups of the two tokenisations (the separators one group of their own)."""
    enc = student(piece, add_special_tokens=False, return_offsets_mapping=True)
    s_ids = np.asarray(enc["input_ids"], np.int64)
    pairs = _groups(np.asarray(teacher_len), owned_lengths(enc["offset_mapping"], len(piece)))
    if separator and student.eos_token_id is not None:
        s_ids = np.append(s_ids, student.eos_token_id)
        pairs.append(((len(teacher_len), len(teacher_len)), (len(s_ids) - 1, len(s_ids) - 1)))
    return s_ids, pairs


def _groups(t_len: np.ndarray, s_len: np.ndarray) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((c, d), (a, b)) token ranges (inclusive) of each group of two partitions of one text, in order."""
    if not len(t_len) or not len(s_len):
        return []
    t_end, s_end = np.cumsum(t_len), np.cumsum(s_len)
    cuts = np.intersect1d(t_end[t_len > 0], s_end[s_len > 0])
    t_group, s_group = _group_of(t_end, cuts), _group_of(s_end, cuts)
    out = []
    for g in range(len(cuts)):
        tt, ss = np.flatnonzero(t_group == g), np.flatnonzero(s_group == g)
        out.append(((int(tt[0]), int(tt[-1])), (int(ss[0]), int(ss[-1]))))
    return out


def _group_of(ends: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Each token's group: the first cut at or past its end, so a token owning nothing joins the group before it."""
    return np.minimum(np.searchsorted(cuts, ends, side="left"), len(cuts) - 1)
