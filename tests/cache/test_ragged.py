"""Cache format version 5 (topkd/cache/format/ragged.py): rows of variable K stored ragged, sampled targets as draw
counts. Round trips against the padded rows, the bit-level pieces by hand, golden bytes, corrupt frames refused."""

import hashlib

import numpy as np
import pytest
import zstandard

from topkd.cache.format import codec, ragged
from topkd.cache.format.shard import (
    RAGGED_VERSION,
    ShardReader,
    TeacherSequence,
    encode_shard,
    write_shard,
)


def test_bit_length_and_contexts_by_hand():
    assert codec.bit_length(np.array([0, 1, 2, 3, 4, 255, 256])).tolist() == [0, 1, 2, 2, 3, 8, 9]
    # widths 1, 3, 0, 9: bitlen 1, 2, -, 4; eighths 8 i // k
    assert codec.gap_contexts(np.array([1, 3, 0, 9])).tolist() == [
        8,
        16,
        18,
        21,
        32,
        32,
        33,
        34,
        35,
        36,
        37,
        38,
        39,
    ]
    assert codec.context_count(50) == 56 and codec.context_count(255) == 72


@pytest.mark.parametrize("seed", [0, 1])
def test_varwidth_and_ragged_rice_round_trip(seed):
    rng = np.random.default_rng(seed)
    widths = rng.integers(0, 17, size=40)
    widths[3] = 0
    bits = rng.integers(0, 57, size=widths.sum())  # up to 56 bits a value
    values = rng.integers(0, 2**62, size=bits.size) & ((1 << bits) - 1)
    assert np.array_equal(codec.unpack_varwidth(codec.pack_varwidth(values, bits), bits), values)
    ids = np.concatenate([np.sort(rng.choice(5000, size=w, replace=False)) for w in widths])
    gaps = np.concatenate(
        [np.diff(np.sort(r), prepend=-1) - 1 for r in np.split(ids, np.cumsum(widths)[:-1])]
    )
    table = codec.best_context_parameters(gaps, codec.gap_contexts(widths), codec.context_count(16))
    bits_per_entry = codec.entry_bits(widths, table)
    rem, unary = codec.encode_rice_ragged(gaps, bits_per_entry)
    assert np.array_equal(codec.decode_rice_ragged(rem, unary, widths, bits_per_entry), ids)
    with pytest.raises(ValueError, match="remainder stream: expected"):
        codec.unpack_varwidth(np.zeros(1, np.uint8), np.array([9]))


def sampled_sequence(t, n, vocab, seed, mask=None):
    """t rows of n draws each from a skewed distribution: distinct ids, log(count / n), count then id order."""
    rng = np.random.default_rng(seed)
    ids, lp = np.zeros((t, n), np.int64), np.full((t, n), -np.inf, np.float32)
    for r in range(t):
        draws = rng.zipf(1.3, size=n) % vocab
        uniq, counts = np.unique(draws, return_counts=True)
        order = np.lexsort((uniq, -counts))
        ids[r, : len(uniq)], ids[r, len(uniq) :] = uniq[order], uniq[order][0]
        lp[r, : len(uniq)] = np.log(counts[order] / n)
    return TeacherSequence(
        input_ids=rng.integers(0, vocab, t),
        ids=ids,
        logprobs=lp,
        log_mass=np.zeros(t, np.float32),
        log_tail=np.full(t, -np.inf, np.float32),
        logz=np.zeros((t, 0), np.float32),
        doc_starts=np.array([0]),
        log_mass_t=np.zeros((t, 0), np.float32),
        row_mask=mask,
    )


def _write(tmp_path, seqs, vocab, **kw):
    arrays, meta = encode_shard(
        seqs, vocab=vocab, identity={"build_hash": "cd" * 32, "shard": 0}, variable_k=True, **kw
    )
    path = str(tmp_path / "s.safetensors")
    write_shard(path, arrays, meta)
    return path, arrays, meta


@pytest.mark.parametrize(
    "n,vocab,t", [(50, 49152, 37), (1, 300, 5), (255, 201088, 3), (7, 70000, 1)]
)
def test_sampled_rows_round_trip_exactly(tmp_path, n, vocab, t):
    seqs = [
        sampled_sequence(t, n, vocab, 0),
        sampled_sequence(t + 2, n, vocab, 1, mask=np.arange(t + 2) % 3 > 0),
    ]
    path, arrays, meta = _write(tmp_path, seqs, vocab, samples=n)
    assert (
        meta["format_version"] == str(RAGGED_VERSION)
        and meta["values"] == "counts"
        and meta["masked"] == "1"
    )
    assert "log_mass" not in arrays and arrays["input_ids"].dtype == (
        np.uint16 if vocab <= 2**16 else np.int32
    )
    reader = ShardReader(path)
    for j, seq in enumerate(seqs):
        got = reader.sequence(j)
        # bit for bit
        assert np.array_equal(got.ids, seq.ids) and np.array_equal(got.logprobs, seq.logprobs)
        # a masked shard: every sequence
        mask = np.ones(len(seq), bool) if seq.row_mask is None else seq.row_mask
        assert np.array_equal(got.input_ids, seq.input_ids) and np.array_equal(got.row_mask, mask)
        assert (
            (got.log_mass == 0).all()
            and np.isneginf(got.log_tail).all()
            and got.logz.shape == (len(seq), 0)
        )


def test_rows_of_log_probs_round_trip_beside_the_padded_codec(tmp_path):
    """Adaptive (top-p) rows keep their log-prob codes: version 5 decodes exactly what version 4 (rice) does,
    also at K > 255 (widths in two bytes)."""
    rng = np.random.default_rng(3)
    t, k, vocab = 9, 300, 5000
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(t)])
    lp = np.sort(rng.normal(-8, 3, size=(t, k)), axis=1)[:, ::-1].astype(np.float32)
    lp[np.arange(k)[None, :] >= rng.integers(1, k + 1, size=(t, 1))] = -np.inf
    mass = np.log(np.exp(lp.astype(np.float64)).sum(1)).astype(np.float32)
    seq = TeacherSequence(
        input_ids=np.arange(t),
        ids=ids,
        logprobs=lp,
        log_mass=mass,
        log_tail=mass - 1,
        logz=np.zeros((t, 0), np.float32),
        doc_starts=np.array([0]),
        log_mass_t=np.zeros((t, 0), np.float32),
    )
    path, _, meta = _write(tmp_path, [seq], vocab)
    assert meta["format_version"] == "5" and meta["values"] == "logprobs" and meta["masked"] == "0"
    arrays, meta4 = encode_shard([seq], vocab=vocab, codec_name="rice", variable_k=True)
    write_shard(str(tmp_path / "v4"), arrays, meta4)
    got, want = ShardReader(path).sequence(0), ShardReader(str(tmp_path / "v4")).sequence(0)
    assert np.array_equal(got.logprobs, want.logprobs) and np.array_equal(got.ids, want.ids)
    assert np.array_equal(got.log_tail, seq.log_tail) and got.row_mask is None


GOLDEN_V5_SHA256 = "231eab95a84be87c180d6cddc80526e106400b54d0c4f5ab3da8caa9e92163da"
# widths | counts | low bits 1, 1, 178 (b=8), 1 | unary 1, 2, 2, 2
GOLDEN_V5_FRAME = "030101020104cb066d03"


def test_golden_version_5_shard(tmp_path):
    """Two rows of N = 4 draws: ids {9: 2, 3: 1, 700: 1} and {5: 4}. The frame holds the widths (3, 1), the counts
    in ascending-id order (1, 2, 1 | 4), the gaps' low bits at their contexts' parameters, then the unary parts."""
    with np.errstate(divide="ignore"):
        lp = np.log(np.array([[2, 1, 1], [4, 0, 0]]) / 4).astype(np.float32)
    seq = TeacherSequence(
        input_ids=np.array([1, 2]),
        ids=np.array([[9, 3, 700], [5, 5, 5]]),
        logprobs=lp,
        log_mass=np.zeros(2, np.float32),
        log_tail=np.full(2, -np.inf, np.float32),
        logz=np.zeros((2, 0), np.float32),
        doc_starts=np.array([0]),
        log_mass_t=np.zeros((2, 0), np.float32),
    )
    arrays, meta = encode_shard(
        [seq],
        vocab=1000,
        identity={"build_hash": "ab" * 32, "shard": 0, "sequences": "0,1"},
        variable_k=True,
        samples=4,
    )
    frame = zstandard.ZstdDecompressor().decompress(arrays["zstd_frames"].tobytes())
    assert frame[:2] == bytes([3, 1]) and frame[2:6] == bytes([1, 2, 1, 4])
    assert frame.hex() == GOLDEN_V5_FRAME, frame.hex()
    write_shard(str(tmp_path / "s"), arrays, meta)
    assert hashlib.sha256((tmp_path / "s").read_bytes()).hexdigest() == GOLDEN_V5_SHA256
    got = ShardReader(str(tmp_path / "s")).sequence(0)
    assert got.ids.tolist() == [[9, 3, 700], [5, 5, 5]] and np.array_equal(got.logprobs, lp)


def _rewrite_frame(path, arrays, meta, edit):
    """The shard with sequence 0's decompressed frame edited (and re-compressed: only the content is wrong)."""
    raw = bytearray(zstandard.ZstdDecompressor().decompress(arrays["zstd_frames"].tobytes()))
    frame = zstandard.ZstdCompressor().compress(bytes(edit(raw)))
    write_shard(
        path,
        {
            **arrays,
            "zstd_frames": np.frombuffer(frame, np.uint8),
            "frame_offsets": np.array([0, len(frame)], np.int64),
        },
        meta,
    )
    return ShardReader(path)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda raw: raw[:2] + bytes([raw[2] + 1]) + raw[3:], "sum to 16"),  # a count changed
        (lambda raw: bytes([17]) + raw[1:], "more than K=16"),  # a width beyond K
        (lambda raw: raw[:6], "too short"),  # cut inside the counts
        (lambda raw: raw[:-1], "unary stream: expected"),  # cut inside the unary stream
    ],
)
def test_corrupt_frames_are_refused(tmp_path, edit, match):
    path, arrays, meta = _write(tmp_path, [sampled_sequence(4, 16, 300, 5)], 300, samples=16)
    with pytest.raises(ValueError, match=match):
        _rewrite_frame(path, arrays, meta, edit).sequence(0)


def test_log_probs_that_are_not_draw_counts_are_refused():
    with pytest.raises(ValueError, match=r"expected every log-prob to be log\(count / 8\)"):
        ragged.count_codes(np.log(np.array([0.3, 0.7], np.float32)), 8)
    with pytest.raises(ValueError, match="1 <= samples <= 255"):
        ragged.count_codes(np.zeros(1, np.float32), 256)
