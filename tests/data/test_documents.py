"""Cache input: packing into sequences with document starts, JSONL and .npy inputs, refusals."""

import json

import numpy as np
import pytest

from topkd.data.documents import iter_documents, pack_sequences, position_ids


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 for c in text]}


def test_packing_cuts_sequences_and_records_document_starts():
    docs = [np.arange(5), np.arange(100, 103), np.arange(200, 211)]
    seqs = list(pack_sequences(iter(docs), 4, separator=-1))
    stream = np.concatenate([np.append(d, -1) for d in docs])
    assert np.array_equal(np.concatenate([s.tokens for s in seqs]), stream)  # nothing dropped
    assert [len(s.tokens) for s in seqs] == [4, 4, 4, 4, 4, 2]
    assert [list(s.doc_starts) for s in seqs] == [[0], [0, 2], [0, 2], [0], [0], [0]]
    assert [s.token_offset for s in seqs] == [0, 4, 8, 12, 16, 20] and [
        s.index for s in seqs
    ] == list(range(6))


def test_ready_made_sequences_from_a_2d_array(tmp_path):
    np.save(tmp_path / "seqs.npy", np.arange(12).reshape(3, 4).astype(np.int32))
    np.save(tmp_path / "stream.npy", np.arange(5).astype(np.int64))
    docs = iter_documents(
        [str(tmp_path / "stream.npy"), str(tmp_path / "seqs.npy")], CharTokenizer()
    )
    seqs = list(pack_sequences(docs, 4, separator=None))
    assert [s.tokens.tolist() for s in seqs] == [
        [0, 1, 2, 3],
        [4],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    assert [s.token_offset for s in seqs] == [0, 4, 5, 9, 13]


def test_jsonl_documents_and_their_errors(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"body": "abc"}) + "\n\n" + json.dumps({"body": "de"}) + "\n")
    assert [d.tolist() for d in iter_documents([str(good)], CharTokenizer(), "body")] == [
        [47, 48, 49],
        [0, 1],
    ]
    with pytest.raises(ValueError, match="string field 'text'"):
        list(iter_documents([str(good)], CharTokenizer()))
    bad = tmp_path / "b.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="b.jsonl:1: expected one JSON object per line"):
        list(iter_documents([str(bad)], CharTokenizer()))


@pytest.mark.parametrize(
    "name,content,match", [("x.csv", "a", "ending in"), ("f.npy", None, "integer array")]
)
def test_unsupported_inputs_are_refused(tmp_path, name, content, match):
    path = tmp_path / name
    if content is None:
        np.save(path, np.zeros((2, 2, 2)))
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        list(iter_documents([str(path)], CharTokenizer()))


def test_seq_len_must_be_at_least_two():
    with pytest.raises(ValueError, match="seq_len: expected >= 2"):
        list(pack_sequences(iter([np.arange(3)]), 1, None))


def test_position_ids_restart_at_document_starts():
    assert position_ids(7, [0, 3, 5]).tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert position_ids(4, []).tolist() == [0, 1, 2, 3]  # row 0 always starts


def test_a_huge_single_line_is_read_in_bounded_blocks(tmp_path, monkeypatch):
    """40 MB on one line: --max-sequences reads only what it uses, and no block exceeds TEXT_BLOCK_CHARS."""
    import itertools

    from topkd.data import documents as data

    monkeypatch.setattr(data, "TEXT_BLOCK_CHARS", 1 << 16)
    path = tmp_path / "one-line.txt"
    with open(path, "w") as f:
        for _ in range(40):
            f.write("word " * ((1 << 20) // 5))  # 1 MB per write, never a newline
    seen = []

    class Counting(CharTokenizer):
        def __call__(self, text, add_special_tokens=False):
            seen.append(len(text))
            return super().__call__(text)

    seqs = list(
        itertools.islice(pack_sequences(iter_documents([str(path)], Counting()), 1000, 0), 3)
    )
    # one block of at most twice the block size
    assert len(seqs) == 3 and sum(seen) <= 2 * (1 << 16)
    whole_text = path.read_text()[: sum(seen)]
    assert all(len(s.tokens) == 1000 for s in seqs) and whole_text.startswith("word word")


def test_text_blocks_cut_long_lines_at_spaces_and_keep_every_character(tmp_path, monkeypatch):
    from topkd.data import documents as data

    monkeypatch.setattr(data, "TEXT_BLOCK_CHARS", 64)
    text = "short line\n" + " ".join(f"w{i}" for i in range(200)) + "\nx" * 3 + "y" * 150 + "\n"
    (tmp_path / "t.txt").write_text(text)
    blocks = list(data._text_blocks(str(tmp_path / "t.txt")))
    assert "".join(blocks) == text
    # a spaceless run is cut hard
    assert all(b.endswith((" ", "\n")) for b in blocks if "yyyy" not in b)
    assert max(len(b) for b in blocks) <= 2 * 64


def _spelled_pieces(seq):
    """A packed sequence's text cut at its tokens' owned spans."""
    ends = np.cumsum(seq.char_len)
    return [seq.text[a:e] for a, e in zip(np.concatenate([[0], ends[:-1]]), ends)]


def test_packed_sequences_carry_the_text_their_tokens_own(teacher_dir, documents_file, tmp_path):
    """with_text: every sequence's owned spans partition its text, a separator owns nothing, and the texts of all
    sequences, in order, are the documents' texts (a .txt document read in blocks too)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    texts = [json.loads(line)["text"] for line in open(documents_file)]
    big = tmp_path / "big.txt"
    big.write_text("é — crown\n" * 40)
    docs = iter_documents([documents_file, str(big)], tok, with_text=True)
    seqs = list(pack_sequences(docs, 7, separator=tok.eos_token_id))
    assert all(len(s.char_len) == len(s.tokens) and s.char_len.sum() == len(s.text) for s in seqs)
    assert "".join(s.text for s in seqs) == "".join(texts) + big.read_text()
    separators = np.concatenate([s.tokens == tok.eos_token_id for s in seqs])
    assert (np.concatenate([s.char_len for s in seqs])[separators] == 0).all()
    some = next(s for s in seqs if len(s.doc_starts) > 1)
    assert "".join(_spelled_pieces(some)) == some.text
    # without with_text nothing changes: bare ids
    plain = list(pack_sequences(iter_documents([documents_file], tok), 7, tok.eos_token_id))
    assert plain[0].text is None and plain[0].char_len is None


def test_ids_without_text_make_sequences_without_text(tmp_path):
    np.save(tmp_path / "stream.npy", np.arange(9).astype(np.int64))
    docs = iter_documents([str(tmp_path / "stream.npy")], CharTokenizer(), with_text=True)
    assert all(s.text is None for s in pack_sequences(docs, 4, separator=None))
