"""Cache input: text, JSONL or pre-tokenised arrays -> fixed-length token sequences.

    for seq in pack_sequences(iter_documents(paths, tokenizer), seq_len=2048, separator=eos_id): ...

Documents are tokenised with the teacher's tokenizer, each followed by the separator (EOS),
concatenated and cut into `seq_len` pieces; the last piece may be shorter (never dropped).
A .txt file is one document, read and tokenised lazily in ~1 MB blocks cut at line ends (or, in a
line longer than that, at a space), so the memory a build needs does not grow with the file and
`--max-sequences` reads only what it uses.
Each sequence records where documents start in it, so training can reset positions and mask
attention and loss across them. A 2-D .npy array is taken as ready-made sequences, one per row.
With `with_text=True` (cache build) text documents come as TextTokens, and each sequence cut from them carries
its text and the characters each token owns (topkd.data.spans): what cross-tokenizer students re-tokenise.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from topkd.data.chat import ChatDocument, chat_document, check_text
from topkd.data.spans import owned_lengths

TEXT_BLOCK_CHARS = 1 << 20  # a large text file is tokenised in blocks of whole lines
SUFFIXES = (".txt", ".jsonl", ".npy")


@dataclass
class Sequence:
    tokens: np.ndarray  # [L] int64
    doc_starts: np.ndarray  # positions in [0, L) where a document begins
    index: int  # sequence number in the source data
    token_offset: int  # offset of tokens[0] in the concatenated token stream
    # [L] bool: row t counts (token t + 1 is a target); None: every row
    row_mask: np.ndarray | None = None
    text: str | None = None  # the text the tokens spell (None: ids without text, e.g. .npy)
    char_len: np.ndarray | None = None  # [L] int64: characters of text each token owns


@dataclass
class TextTokens:
    """Tokens with the text they spell: token i owns char_len[i] characters of text (topkd.data.spans)."""

    tokens: np.ndarray  # [L] int64
    char_len: np.ndarray  # [L] int64, sums to len(text)
    text: str

    def __len__(self) -> int:
        return len(self.tokens)


def check_paths(paths: list[str]) -> None:
    if not paths:
        raise ValueError("data: expected at least one file (.txt, .jsonl or .npy), got none")
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"data: expected an existing file, got {p!r}; check the path")
        if not p.endswith(SUFFIXES):
            raise ValueError(
                f"data: expected a file ending in {SUFFIXES}, got {p!r}; convert it, or pass "
                "pre-tokenised ids as a .npy array"
            )


def iter_documents(
    paths: list[str],
    tokenizer,
    text_field: str = "text",
    vocab: int | None = None,
    messages_field: str = "messages",
    train_on: str = "assistant",
    with_text: bool = False,
) -> Iterator[np.ndarray | list | Iterator[np.ndarray] | ChatDocument]:
    """One item per document: a token array (.jsonl text, 1-D .npy), a ChatDocument (.jsonl conversation in
    messages_field, see topkd.data.chat), an iterator of token blocks (.txt, read lazily), or a list of arrays
    (a 2-D .npy: ready-made sequences). vocab: refuse ids outside [0, vocab). with_text (a fast tokenizer's
    offsets needed): text comes as TextTokens instead of arrays."""
    check_paths(paths)
    encode = _encode_with_text if with_text else _encode
    for path in paths:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r")
            if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(
                    f"{path}: expected a 1-D token stream or 2-D [sequences, length] integer array, "
                    f"got {arr.ndim}-D {arr.dtype}"
                )
            if vocab is not None:
                _check_ids(path, arr, vocab)
            yield (
                np.asarray(arr, dtype=np.int64)
                if arr.ndim == 1
                else [np.asarray(r, np.int64) for r in arr]
            )
        elif path.endswith(".jsonl"):
            yield from _jsonl_documents(
                path, tokenizer, text_field, messages_field, train_on, encode
            )
        else:
            yield (encode(tokenizer, block) for block in _text_blocks(path))


def whole(document) -> np.ndarray:
    """A document's tokens as one array (a .txt document comes as an iterator of blocks)."""
    if isinstance(document, (ChatDocument, TextTokens)):
        return document.tokens
    if isinstance(document, np.ndarray):
        return document
    parts = [whole(part) for part in document]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _check_ids(path: str, arr: np.ndarray, vocab: int, block: int = 1 << 24) -> None:
    flat = arr.reshape(-1)
    for a in range(0, flat.size, block):  # blocks: a memory-mapped array is never read whole
        part = np.asarray(flat[a : a + block])
        bad = np.flatnonzero((part < 0) | (part >= vocab))
        if bad.size:
            where = np.unravel_index(a + int(bad[0]), arr.shape)
            raise ValueError(
                f"{path}: token id {int(part[bad[0]])} at position {tuple(int(i) for i in where)} is "
                f"outside the teacher's vocabulary [0, {vocab}); were these ids made with another "
                "tokenizer? Re-tokenise with the teacher's, or pass the text instead"
            )


def jsonl_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of every non-blank line of a .jsonl file; bad UTF-8 or JSON names its line."""
    with _utf8_errors(path), open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{line_no}: expected one JSON object per line, got invalid JSON ({e})"
                )
            yield line_no, record


def chat_roles(paths: list[str], messages_field: str = "messages") -> Counter:
    """How often each role occurs in the conversations of the .jsonl files (what a refusal shows)."""
    roles: Counter = Counter()
    for path in (p for p in paths if p.endswith(".jsonl")):
        for _, record in jsonl_records(path):
            messages = record.get(messages_field) if isinstance(record, dict) else None
            roles.update(m.get("role") for m in messages or [] if isinstance(m, dict))
    return roles


def _jsonl_documents(
    path: str, tokenizer, field: str, messages_field: str, train_on: str, encode
) -> Iterator[np.ndarray | TextTokens | ChatDocument]:
    """A text record is one document; a conversation record (messages_field) is one ChatDocument."""
    for line_no, record in jsonl_records(path):
        where = f"{path}:{line_no}"
        if isinstance(record, dict) and messages_field in record and field in record:
            raise ValueError(
                f"{where}: expected either a text field {field!r} or a conversation {messages_field!r}, "
                f"got both; pick one: --messages-field '' reads the text, --text-field '' the "
                "conversation"
            )
        if isinstance(record, dict) and messages_field in record:
            yield chat_document(record[messages_field], tokenizer, train_on, where=where)
            continue
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            keys = list(record)[:5] if isinstance(record, dict) else []
            got = (
                type(record[field]).__name__
                if isinstance(record, dict) and field in record
                else "missing"
            )
            raise ValueError(
                f"{path}:{line_no}: expected an object with a string field {field!r} or a conversation "
                f"in {messages_field!r}, got {type(record).__name__} with keys {keys} ({field}: {got}); "
                "set --text-field or --messages-field"
            )
        check_text(record[field], where, field)
        yield encode(tokenizer, record[field])


def _text_blocks(path: str) -> Iterator[str]:
    """Whole lines, ~TEXT_BLOCK_CHARS at a time; a longer line is cut at its last space (or tab) in the block."""
    block: list[str] = []
    size = 0
    with _utf8_errors(path), open(path, encoding="utf-8", errors="strict") as f:
        for line in _bounded_lines(f, TEXT_BLOCK_CHARS):
            block.append(line)
            size += len(line)
            if size >= TEXT_BLOCK_CHARS:
                yield "".join(block)
                block, size = [], 0
    if block:
        yield "".join(block)


def _bounded_lines(f, limit: int) -> Iterator[str]:
    carry = ""
    while True:
        part = f.readline(limit - len(carry))  # at most this many characters, however long the line
        text = carry + part
        carry = ""
        if not text:
            return
        if not text.endswith("\n") and part and len(text) >= limit:
            # no space at all: a hard cut
            cut = max(text.rfind(" "), text.rfind("\t")) + 1 or len(text)
            text, carry = text[:cut], text[cut:]
        yield text


@contextlib.contextmanager
def _utf8_errors(path: str):
    """A file that is not UTF-8: one line naming the file, the line and byte, and the remedy."""
    try:
        yield
    except UnicodeDecodeError as e:
        line, offset = _first_bad_utf8(path)
        raise ValueError(
            f"{path}:{line}: expected UTF-8 text, got an invalid byte at offset {offset} ({e.reason}); "
            "convert the file (e.g. iconv -f latin1 -t utf-8), or pass token ids as .npy"
        ) from None


def _first_bad_utf8(path: str, block: int = 1 << 20) -> tuple[int, int]:
    decoder, consumed, lines = codecs.getincrementaldecoder("utf-8")(), 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(block):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                offset = consumed - pending + e.start
                return lines + chunk.count(b"\n", 0, max(e.start - pending, 0)), offset
            lines += chunk.count(b"\n")
            consumed += len(chunk)
    return lines, consumed


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def _encode_with_text(tokenizer, text: str) -> TextTokens:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = np.asarray(encoded["input_ids"], dtype=np.int64)
    return TextTokens(tokens, owned_lengths(encoded["offset_mapping"], len(text)), text)


def text_tokens_supported(tokenizer) -> bool:
    """Whether a tokenizer maps tokens to text offsets (a fast, Rust tokenizer), which with_text needs."""
    return bool(getattr(tokenizer, "is_fast", False))


def pack_sequences(documents: Iterable, seq_len: int, separator: int | None) -> Iterator[Sequence]:
    """Concatenate documents (each followed by the separator) and cut into seq_len sequences. Chat documents
    carry targets: then every sequence gets a row mask (row t counts iff token t + 1 is a target; the
    separator after a conversation is not), which needs one token of lookahead across a cut."""
    if seq_len < 2:
        raise ValueError(f"seq_len: expected >= 2, got {seq_len}")
    packer = _Packer(seq_len)
    for doc in documents:
        # ready-made sequences: emitted as they are, after any packed remainder
        if isinstance(doc, list):
            yield from packer.flush()
            yield from packer.ready_made(doc)
            continue
        packer.start_document()
        chat = isinstance(doc, ChatDocument)
        if chat:
            pieces = [doc]
        else:  # token ids: one array, or already cut into pieces
            pieces = [doc] if isinstance(doc, (np.ndarray, TextTokens)) else doc
        # None: the end, where the separator goes
        for piece in itertools.chain(pieces, [None]):
            if piece is None:
                tokens = np.asarray([separator] if separator is not None else [], dtype=np.int64)
                # after a conversation the separator is no target
                targets, spelled = (
                    np.full(len(tokens), not chat),
                    (np.zeros(len(tokens), np.int64), ""),
                )
            else:
                tokens = np.asarray(whole(piece), dtype=np.int64)
                targets = doc.targets if chat else np.ones(len(tokens), dtype=bool)
                spelled = _spelled(piece)
            yield from packer.add(tokens, targets, masked=chat, spelled=spelled)
    yield from packer.flush()


def _spelled(piece) -> tuple[np.ndarray, str] | None:
    """(characters each token owns, the text) of a piece that carries its text; None for bare ids."""
    char_len = getattr(piece, "char_len", None)
    return None if char_len is None else (np.asarray(char_len, np.int64), piece.text)


class _Packer:
    """The token stream being cut into sequences, with document starts, (chat data) per-token targets and, where
    the documents carry it, the text: each token's owned characters (-1: unknown) and the text not yet emitted."""

    def __init__(self, seq_len: int):
        self.seq_len, self.stream, self.targets = seq_len, np.zeros(0, np.int64), np.zeros(0, bool)
        self.chars, self.text = np.zeros(0, np.int64), ""
        self.starts: list[int] = []  # in stream coordinates
        self.offset, self.index, self.masked = 0, 0, False

    def start_document(self) -> None:
        self.starts.append(self.offset + len(self.stream))

    def add(
        self, tokens: np.ndarray, targets: np.ndarray, masked: bool, spelled=None
    ) -> Iterator[Sequence]:
        self.masked = self.masked or masked
        self.stream = np.concatenate([self.stream, tokens])
        self.targets = np.concatenate([self.targets, targets])
        chars, text = spelled if spelled is not None else (np.full(len(tokens), -1), "")
        self.chars, self.text = np.concatenate([self.chars, chars]), self.text + text
        # one token beyond the cut: the last row's target is known
        while len(self.stream) > self.seq_len:
            yield self._emit(self.seq_len, self.targets[1 : self.seq_len + 1])

    def flush(self) -> Iterator[Sequence]:
        if len(self.stream):  # the last row of the data predicts nothing in it
            yield self._emit(len(self.stream), np.concatenate([self.targets[1:], [False]]))

    def ready_made(self, rows: list) -> Iterator[Sequence]:
        for row in rows:
            yield Sequence(row, np.array([0]), self.index, self.offset)
            self.index, self.offset = self.index + 1, self.offset + len(row)

    def _emit(self, n: int, row_targets: np.ndarray) -> Sequence:
        chars = self.chars[:n]
        spelled = bool((chars >= 0).all())
        used = int(chars[chars > 0].sum())  # characters of known text these tokens own
        seq = Sequence(
            self.stream[:n],
            _starts_in(self.starts, self.offset, self.offset + n),
            self.index,
            self.offset,
            row_targets.copy() if self.masked else None,
            text=self.text[:used] if spelled else None,
            char_len=chars.copy() if spelled else None,
        )
        self.starts = [s for s in self.starts if s >= self.offset + n]
        self.stream, self.targets = self.stream[n:], self.targets[n:]
        self.chars, self.text = self.chars[n:], self.text[used:]
        self.offset, self.index = self.offset + n, self.index + 1
        return seq


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
