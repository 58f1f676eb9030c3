"""Which characters of a text each token owns: the span form a cache records and cross-tokenizer alignment reads.

    lengths = owned_lengths(tokenizer(text, return_offsets_mapping=True)["offset_mapping"], len(text))
    ends = np.cumsum(lengths)        # token i owns text[ends[i] - lengths[i] : ends[i]]

A tokenizer's offset mapping may overlap (byte-level BPE gives two tokens of one multi-byte character the same
span), leave gaps (characters a normaliser drops) or give a special token an empty span. Owned lengths make it
a partition: token i owns the characters after the furthest end of tokens 0..i-1 up to its own (furthest) end,
so an overlapping token owns nothing, a gap belongs to the token after it, and the text's trailing characters
to the last token. The lengths sum to len(text) and the text is recovered exactly from them.
"""

from __future__ import annotations

import numpy as np


def owned_lengths(offsets, n_chars: int) -> np.ndarray:
    """[L] int64: the characters each token owns (see the module docstring); sum == n_chars."""
    ends = np.asarray([e for _, e in offsets], dtype=np.int64).reshape(-1)
    if ends.size == 0:
        if n_chars:
            raise ValueError(f"spans: expected tokens for {n_chars} characters of text, got none")
        return np.zeros(0, np.int64)
    if ends.min() < 0 or ends.max() > n_chars:
        raise ValueError(
            f"spans: expected offsets inside the text's {n_chars} characters, got ends "
            f"{int(ends.min())}..{int(ends.max())}; is the offset mapping of another text?"
        )
    furthest = np.maximum.accumulate(ends)
    furthest[-1] = n_chars  # trailing characters the tokenizer dropped: the last token's
    return np.diff(furthest, prepend=0)
