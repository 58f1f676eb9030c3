"""topkd.data.align and the aligned loss end to end: hand-made tokenizers over hand-made spans (identical spans,
a student split, a merge on both sides, a separator), the groups checked by hand, and the loss of a whole
sequence against a float64 oracle written from the definition over full distributions."""

import numpy as np
import pytest
import torch

from topkd.cache.format.shard import TeacherSequence
from topkd.data.align import VocabMap, _groups, align_sequence
from topkd.loss.cross import cross_tokenizer_kd
from topkd.train.cross import batch_targets, student_rows


class PieceTokenizer:
    """Greedy longest-match over a fixed list of strings; id 0 is the eos."""

    def __init__(self, pieces, eos):
        self.pieces, self.eos_token_id, self.all_special_tokens = [eos, *pieces], 0, [eos]

    def __len__(self):
        return len(self.pieces)

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        ids, offsets, i = [], [], 0
        while i < len(text):
            best = max((p for p in self.pieces[1:] if text.startswith(p, i)), key=len)
            ids.append(self.pieces.index(best))
            offsets.append((i, i + len(best)))
            i += len(best)
        return {"input_ids": ids, "offset_mapping": offsets}

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids if i)

    def batch_decode(self, batch):
        return [self.decode(ids) for ids in batch]

    def get_added_vocab(self):
        return {}


TEACHER = PieceTokenizer(["a", "b", "c", " ", "abc", "ca"], "<eos>")  # ids 1..6
STUDENT = PieceTokenizer(["c", " ", "ab", "a", "b"], "<|end|>")


@pytest.mark.parametrize(
    "teacher, student, groups",
    [
        ([3, 1], [3, 1], [((0, 0), (0, 0)), ((1, 1), (1, 1))]),  # identical spans
        ([3], [2, 1], [((0, 0), (0, 1))]),  # a student split
        (
            [2, 1],
            [1, 2],
            [((0, 1), (0, 1))],
        ),  # no common inner boundary: one group, chains on both sides
        ([1, 0, 2], [3], [((0, 2), (0, 0))]),  # a token owning nothing joins the group before it
    ],
)
def test_groups_of_hand_made_spans(teacher, student, groups):
    assert _groups(np.array(teacher), np.array(student)) == groups


def test_the_vocabulary_maps_same_strings_only_and_the_separators():
    vocab = VocabMap.between(TEACHER, STUDENT)
    # teacher: eos a b c ' ' abc ca -> student: <|end|> c ' ' ab a b
    assert vocab.to_student.tolist() == [0, 4, 5, 1, 2, -1, -1]


def _sequence(rng):
    """'c abc cab' then the separator: teacher c|' '|abc|' '|ca|b|<eos>, student c|' '|ab|c|' '|c|ab|<|end|>."""
    text = "c abc cab"
    teacher_ids = np.array([3, 4, 5, 4, 6, 2, 0])
    logits = rng.normal(size=(7, 7)) * 2
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    order = np.argsort(-logp, 1)
    seq = TeacherSequence(
        input_ids=teacher_ids,
        ids=order,
        logprobs=np.take_along_axis(logp, order, 1).astype(np.float32),
        log_mass=np.zeros(7, np.float32),
        log_tail=np.full(7, -np.inf, np.float32),
        logz=np.zeros((7, 0), np.float32),
        doc_starts=np.array([0]),
        text=text,
        char_len=np.array([1, 1, 3, 1, 2, 1, 0]),
    )
    return seq, logp


def _oracle(logp_t, logits_s, mode):
    """The definition by hand: groups (teacher tokens, student tokens, teacher row, student row) of the text."""
    lt = torch.from_numpy(logp_t)
    ls = torch.log_softmax(logits_s.double(), 1)
    t_ids, s_ids = [3, 4, 5, 4, 6, 2, 0], [1, 2, 3, 1, 2, 1, 3, 0]
    groups = [  # (teacher c..d, student a..b); the first group (c | c) has no prediction row
        ((1, 1), (1, 1), True),
        ((2, 2), (2, 3), False),
        ((3, 3), (4, 4), True),
        ((4, 5), (5, 6), False),
        ((6, 6), (7, 7), True),  # the separators
    ]
    to_student = {0: 0, 1: 4, 2: 5, 3: 1, 4: 2}
    total = torch.zeros((), dtype=torch.float64)
    for (c, d), (a, b), one in groups:
        p, q = lt[c - 1].exp(), ls[a - 1].exp()
        if one and mode == "align":
            mapped = [(t, s) for t, s in to_student.items()]
            pm = torch.stack([p[t] for t, _ in mapped])
            qm = torch.stack([q[s] for _, s in mapped])
            pt, qt = 1 - pm.sum(), 1 - qm.sum()
            total = total + (pm * (pm / qm).log()).sum() + pt * (pt / qt).log()
            continue
        p, q = p.clone(), q.clone()
        zero = torch.zeros((), dtype=torch.float64)
        p[t_ids[c]] = p[t_ids[c]] * torch.exp(
            sum((lt[j - 1, t_ids[j]] for j in range(c + 1, d + 1)), zero)
        )
        q[s_ids[a]] = q[s_ids[a]] * torch.exp(
            sum(
                (ls[i - 1, s_ids[i]] for i in range(a + 1, b + 1)),
                torch.zeros((), dtype=torch.float64),
            )
        )
        ps, qs = p.sort(descending=True).values, q.sort(descending=True).values
        qs = torch.cat(
            [qs, torch.zeros(len(ps) - len(qs), dtype=qs.dtype)]
        )  # the shorter vector padded
        total = total + (ps - qs).abs().sum() + (0.0 - (q.sum() - qs.sum())).abs()
    return total


@pytest.mark.parametrize("mode", ["align", "uld"])
def test_the_aligned_loss_of_a_sequence_equals_the_float64_definition(mode):
    rng = np.random.default_rng(0)
    seq, logp_t = _sequence(rng)
    vocab = VocabMap.between(TEACHER, STUDENT)
    aligned = align_sequence(
        seq.text, seq.char_len, seq.input_ids, seq.doc_starts, STUDENT, vocab, 0
    )
    assert aligned.input_ids.tolist() == [1, 2, 3, 1, 2, 1, 3, 0]
    rows = {
        k: torch.from_numpy(np.asarray(v))
        for k, v in student_rows(seq, aligned, vocab, mode, 7).items()
    }
    n = len(aligned.input_ids)
    labels = torch.full((n,), -100)
    labels[:-1] = rows["input_ids"][1:]
    batch = {
        **{k: v[None] for k, v in rows.items()},
        "labels": labels[None],
        "kd_mask": (rows["row_mask"] & (rows["input_ids"] != 0))[None],
    }
    targets = batch_targets(batch)
    g = torch.Generator().manual_seed(1)
    h, w = (
        torch.randn(n, 4, generator=g, dtype=torch.float64),
        torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    loss, _ = cross_tokenizer_kd(h.float(), w.float(), targets)
    assert torch.allclose(loss.double(), _oracle(logp_t, h @ w.T, mode), rtol=1e-5, atol=1e-5)
