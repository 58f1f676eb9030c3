"""Format version 6: each sequence's text and the characters each input token owns, for cross-tokenizer students.

    arrays = text_arrays(sequences)              # {} when no sequence carries text (the shard keeps its version)
    text, char_len = read_text(reader, j, a, e)  # sequence j (rows [a, e)), checked

A version-6 shard is a shard of any earlier layout (meta_json's `layout_version`: 2, 3, 4 or 5, read as that
version) plus three tensors:
- `text_utf8` U8 [bytes]: the sequences' texts, UTF-8, concatenated;
- `text_offsets` I64 [S+1]: byte offsets of each sequence's text in text_utf8, from 0 to its size;
- `char_len` I32 [T]: the characters of its sequence's text that row t's input token owns (topkd.data.spans: an
  overlapping token owns 0, a separator 0); a sequence's lengths sum to its text's length in characters.
A student with another tokenizer re-tokenises the text and aligns its tokens to the teacher's by these spans,
without the teacher (topkd.data.align).
"""

from __future__ import annotations

import numpy as np

TEXT_VERSION = 6
TEXT_TENSORS = frozenset({"text_utf8", "text_offsets", "char_len"})


def text_arrays(seqs) -> dict[str, np.ndarray]:
    """The text tensors of a shard's sequences: all of them carry text, or none (then {})."""
    spelled = [s.text is not None and s.char_len is not None for s in seqs]
    if not any(spelled):
        return {}
    if not all(spelled):
        raise ValueError(
            "text: expected every sequence of a shard with its text or none, got "
            f"{sum(spelled)} of {len(seqs)}; a shard mixes text and bare ids only if its data did"
        )
    for s in seqs:
        if (
            int(np.sum(s.char_len)) != len(s.text)
            or len(s.char_len) != len(s)
            or (s.char_len < 0).any()
        ):
            raise ValueError(
                f"text of sequence {s.source_index}: expected {len(s)} owned lengths >= 0 summing to its "
                f"{len(s.text)} characters, got {len(s.char_len)} summing to {int(np.sum(s.char_len))}"
            )
    encoded = [s.text.encode("utf-8") for s in seqs]
    return {
        "text_utf8": np.frombuffer(b"".join(encoded), np.uint8).copy(),
        "text_offsets": np.concatenate([[0], np.cumsum([len(b) for b in encoded])]).astype(
            np.int64
        ),
        "char_len": np.concatenate([s.char_len for s in seqs]).astype(np.int32),
    }


def read_text(reader, j: int, a: int, e: int) -> tuple[str, np.ndarray]:
    """Sequence j's text and owned lengths (rows [a, e)); anything that does not fit is refused as corrupt."""
    offsets = reader.tensor("text_offsets")
    size = reader.shape("text_utf8")[0]
    if (
        offsets.shape != (len(reader) + 1,)
        or offsets[0] != 0
        or offsets[-1] != size
        or (np.diff(offsets) < 0).any()
    ):
        raise reader.error(f"text_offsets must rise from 0 to {size} in {len(reader) + 1} steps")
    start, end = int(offsets[j]), int(offsets[j + 1])
    # an empty slice at the end is out of safetensors' bounds: no bytes to read
    raw = reader.rows("text_utf8", start, end).tobytes() if end > start else b""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise reader.error(f"sequence {j}'s text is not UTF-8 ({err.reason})") from None
    char_len = reader.rows("char_len", a, e).astype(np.int64)
    if (char_len < 0).any() or int(char_len.sum()) != len(text):
        raise reader.error(
            f"sequence {j}'s owned lengths sum to {int(char_len.sum())}, its text has {len(text)} characters"
        )
    return text, char_len
