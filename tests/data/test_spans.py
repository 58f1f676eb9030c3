"""topkd.data.spans: the characters each token owns, from offset mappings that overlap, leave gaps or are empty."""

import numpy as np
import pytest

from topkd.data.spans import owned_lengths


@pytest.mark.parametrize(
    "offsets, n, expected",
    [
        ([(0, 3), (3, 4), (4, 9)], 9, [3, 1, 5]),  # a partition already
        (
            [(0, 2), (1, 2), (2, 5)],
            5,
            [2, 0, 3],
        ),  # byte tokens of one character: the second owns nothing
        ([(1, 3), (4, 6)], 8, [3, 5]),  # a dropped leading and trailing gap
        ([(0, 0), (0, 4), (4, 4)], 4, [0, 4, 0]),  # empty spans (special tokens)
        ([], 0, []),
    ],
)
def test_owned_lengths_partition_the_text(offsets, n, expected):
    lengths = owned_lengths(offsets, n)
    assert lengths.tolist() == expected and lengths.sum() == n and (lengths >= 0).all()


def test_owned_lengths_refuse_offsets_of_another_text():
    with pytest.raises(ValueError, match="inside the text's 3 characters"):
        owned_lengths([(0, 5)], 3)
    with pytest.raises(ValueError, match="expected tokens for 2 characters"):
        owned_lengths([], 2)


def test_a_real_tokenizer_spells_its_text_back(teacher_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    text = "Sweet  king, é—crown.\n\nlove"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = np.cumsum(owned_lengths(enc["offset_mapping"], len(text)))
    pieces = [text[a:e] for a, e in zip(np.concatenate([[0], ends[:-1]]), ends)]
    assert "".join(pieces) == text and len(pieces) == len(enc["input_ids"])
