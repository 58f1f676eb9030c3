"""Cache input: text, JSONL or pre-tokenised arrays -> fixed-length token sequences.

    for seq in pack_sequences(iter_documents(paths, tokenizer), seq_len=2048, separator=eos_id): ...

Documents are tokenised with the teacher's tokenizer, each followed by the separator (EOS),
concatenated and cut into `seq_len` pieces; the last piece may be shorter (never dropped).
Each sequence records where documents start in it, so training can reset positions and mask
attention and loss across them. A 2-D .npy array is taken as ready-made sequences, one per row.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

TEXT_BLOCK_CHARS = 1 << 20  # a large text file is tokenised in blocks of whole lines
SUFFIXES = (".txt", ".jsonl", ".npy")


@dataclass
class Sequence:
    tokens: np.ndarray  # [L] int64
    doc_starts: np.ndarray  # positions in [0, L) where a document begins
    index: int  # sequence number in the source data
    token_offset: int  # offset of tokens[0] in the concatenated token stream


def check_paths(paths: list[str]) -> None:
    if not paths:
        raise ValueError("data: expected at least one file (.txt, .jsonl or .npy), got none")
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"data: expected an existing file, got {p!r}; check the path")
        if not p.endswith(SUFFIXES):
            raise ValueError(f"data: expected a file ending in {SUFFIXES}, got {p!r}; convert it, or pass "
                             "pre-tokenised ids as a .npy array")


def iter_documents(paths: list[str], tokenizer, text_field: str = "text") -> Iterator[np.ndarray | list]:
    """Token arrays, one per document; a 2-D .npy yields its rows as a list (ready-made sequences)."""
    check_paths(paths)
    for path in paths:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r")
            if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{path}: expected a 1-D token stream or 2-D [sequences, length] integer array, "
                                 f"got {arr.ndim}-D {arr.dtype}")
            yield np.asarray(arr, dtype=np.int64) if arr.ndim == 1 else [np.asarray(r, np.int64) for r in arr]
        elif path.endswith(".jsonl"):
            yield from _jsonl_documents(path, tokenizer, text_field)
        else:
            yield _tokenize_blocks(_text_blocks(path), tokenizer)


def _jsonl_documents(path: str, tokenizer, field: str) -> Iterator[np.ndarray]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: expected one JSON object per line, got invalid JSON ({e})")
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                keys = list(record)[:5] if isinstance(record, dict) else []
                raise ValueError(f"{path}:{line_no}: expected an object with a string field {field!r}, got "
                                 f"{type(record).__name__} with keys {keys}; set --text-field")
            yield _encode(tokenizer, record[field])


def _text_blocks(path: str) -> Iterator[str]:
    block: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="strict") as f:
        for line in f:
            block.append(line)
            size += len(line)
            if size >= TEXT_BLOCK_CHARS:
                yield "".join(block)
                block, size = [], 0
    if block:
        yield "".join(block)


def _tokenize_blocks(blocks: Iterable[str], tokenizer) -> np.ndarray:
    parts = [_encode(tokenizer, b) for b in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def pack_sequences(documents: Iterable, seq_len: int, separator: int | None) -> Iterator[Sequence]:
    """Concatenate documents (each followed by the separator) and cut into seq_len sequences."""
    if seq_len < 2:
        raise ValueError(f"seq_len: expected >= 2, got {seq_len}")
    stream, pos, starts, offset, index = np.zeros(0, np.int64), 0, [], 0, 0
    for doc in documents:
        if isinstance(doc, list):  # ready-made sequences: emitted as they are, after any packed remainder
            if len(stream) > pos:
                yield Sequence(stream[pos:], _starts_in(starts, offset, offset + len(stream) - pos), index, offset)
                offset, index, stream, pos, starts = offset + len(stream) - pos, index + 1, stream[:0], 0, []
            for row in doc:
                yield Sequence(row, np.array([0]), index, offset)
                index, offset = index + 1, offset + len(row)
            continue
        starts.append(offset + len(stream) - pos)  # in stream coordinates
        stream = np.concatenate([stream[pos:], doc] + ([[separator]] if separator is not None else []))
        pos = 0
        while len(stream) - pos >= seq_len:
            yield Sequence(stream[pos:pos + seq_len], _starts_in(starts, offset, offset + seq_len), index, offset)
            starts = [s for s in starts if s >= offset + seq_len]
            pos, offset, index = pos + seq_len, offset + seq_len, index + 1
    if len(stream) > pos:
        yield Sequence(stream[pos:], _starts_in(starts, offset, offset + len(stream) - pos), index, offset)


def _starts_in(starts: list[int], a: int, e: int) -> np.ndarray:
    """Document starts inside [a, e); position 0 always counts as a start (a document continues there)."""
    inside = sorted({0, *(s - a for s in starts if a <= s < e)})
    return np.array(inside, dtype=np.int64)


def position_ids(length: int, doc_starts) -> np.ndarray:
    """Positions restarting at 0 at every document start (and at row 0): per-document causal attention."""
    starts = np.zeros(length, dtype=bool)
    starts[np.asarray(doc_starts, dtype=np.int64)] = True
    starts[0] = True
    idx = np.arange(length)
    return idx - np.maximum.accumulate(np.where(starts, idx, 0))
