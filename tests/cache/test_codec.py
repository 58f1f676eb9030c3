"""Codecs: bit packing at ceil(log2 V) for large V, Rice-coded id gaps, log-prob quantisation error."""

import math

import numpy as np
import pytest

from topkd.cache.format import codec


def random_topk(t, k, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(t)]).astype(np.int64)


@pytest.mark.parametrize(
    "vocab,bits",
    [(2, 1), (1000, 10), (49152, 16), (201088, 18), (262144, 18), (2**20, 20), (2**20 + 1, 21)],
)
def test_id_bits_is_ceil_log2(vocab, bits):
    assert codec.id_bits(vocab) == bits == max(1, math.ceil(math.log2(vocab)))


@pytest.mark.parametrize(
    "vocab,k,t", [(201088, 100, 7), (262144, 100, 5), (2**20, 33, 3), (5, 5, 4), (7, 1, 9)]
)
def test_pack_round_trip(vocab, k, t):
    ids = random_topk(t, k, vocab)
    ids[0, 0] = vocab - 1  # the largest id must fit
    packed = codec.pack_bits(ids, codec.id_bits(vocab))
    assert packed.shape == (t, math.ceil(k * codec.id_bits(vocab) / 8)) and packed.dtype == np.uint8
    assert np.array_equal(codec.unpack_bits(packed, k, codec.id_bits(vocab)), ids)


@pytest.mark.parametrize(
    "vocab,k,t", [(201088, 100, 6), (262144, 100, 4), (1000, 1, 11), (9, 9, 3), (2**20, 17, 5)]
)
def test_rice_round_trip(vocab, k, t):
    ids = random_topk(t, k, vocab, seed=vocab % 97)
    order, gaps = codec.sorted_gaps(ids)
    b = codec.best_rice_parameter(gaps)
    rem, stream = codec.encode_rice(gaps, b)
    decoded = codec.decode_rice(rem, stream, k, b)
    assert np.array_equal(decoded, np.take_along_axis(ids, order, 1))
    assert np.array_equal(np.sort(decoded, 1), decoded)


def test_rice_parameter_minimises_the_exact_size():
    gaps = np.random.default_rng(1).geometric(1 / 300, size=5000) - 1
    b = codec.best_rice_parameter(gaps)
    # bits at Rice parameter p
    sizes = [int((gaps >> p).sum()) + gaps.size * (1 + p) for p in range(20)]
    assert sizes[b] == min(sizes)
    assert 7 <= b <= 9  # mean gap ~300: b ~ log2(300 ln 2)


def test_repeated_ids_are_refused():
    with pytest.raises(ValueError, match="repeated id"):
        codec.sorted_gaps(np.array([[3, 5, 3]]))


def test_truncated_unary_stream_is_refused():
    stream = codec.encode_unary(np.array([0, 9, 2]))
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode_unary(stream[:1], 3)


def teacher_like_logprobs(t, vocab, k, scale, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((t, vocab)) * scale
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    return -np.sort(-logp, axis=1)[:, :k]


@pytest.mark.parametrize("scale", [1.0, 3.0, 6.0])
def test_quantisation_keeps_exact_mass_and_small_kl(scale):
    a = teacher_like_logprobs(300, 5000, 100, scale)
    log_mass = np.log(np.exp(a).sum(1))
    decoded = codec.dequantise_logprobs(
        codec.quantise_logprobs(a), log_mass.astype(np.float32)
    ).astype(np.float64)
    # mass split with the tail exact
    assert np.allclose(np.log(np.exp(decoded).sum(1)), log_mass, atol=1e-6)
    kl = (np.exp(a) * (a - decoded)).sum(1)
    assert kl.mean() < 1e-4 and kl.max() < 1e-3
    top_gap = np.abs(decoded[:, 0] - a[:, 0]).max()
    assert top_gap < 0.02  # fine steps where the mass is


def test_quantisation_k1_and_far_tail():
    a = np.array([[-0.1], [-3.0]])
    decoded = codec.dequantise_logprobs(codec.quantise_logprobs(a), a[:, 0].astype(np.float32))
    assert np.allclose(decoded, a, atol=1e-6)
    far = np.array([[-0.01, -50.0]])  # 50 nats below: clamped to the last code, finite
    d = codec.dequantise_logprobs(
        codec.quantise_logprobs(far), np.log(np.exp(far).sum(1)).astype(np.float32)
    )
    assert np.isfinite(d).all() and d[0, 1] < -15


def test_bad_codes_are_refused():
    with pytest.raises(ValueError, match="corrupt"):
        codec.dequantise_logprobs(np.array([[255]], dtype=np.uint8), np.zeros(1, np.float32))


@pytest.mark.parametrize("codec_name", ["rice-zstd", "rice", "packed"])
@pytest.mark.parametrize("vocab", [201088, 262144, 2**20])
def test_shard_round_trip_at_large_vocabularies(tmp_path, codec_name, vocab):
    from topkd.cache.format.shard import ShardReader, TeacherSequence, encode_shard, write_shard

    k, lengths = 100, (5, 3)
    seqs = []
    for s, n in enumerate(lengths):
        ids = random_topk(n, k, vocab, seed=s)
        ids[0, :3] = [vocab - 1, 0, vocab // 2]  # extremes of the id range
        lp = teacher_like_logprobs(n, 3000, k, 3.0, seed=s)
        mass = np.log(np.exp(lp).sum(1))
        seqs.append(
            TeacherSequence(
                np.arange(n),
                ids,
                lp.astype(np.float32),
                mass.astype(np.float32),
                np.log1p(-np.exp(mass)).astype(np.float32),
                np.zeros((n, 0), np.float32),
                np.array([0]),
                s,
                5 * s,
            )
        )
    arrays, meta = encode_shard(seqs, vocab=vocab, codec_name=codec_name)
    write_shard(str(tmp_path / "s.safetensors"), arrays, meta)
    reader = ShardReader(str(tmp_path / "s.safetensors"))
    for s, seq in enumerate(seqs):
        got = reader.sequence(s)
        assert np.array_equal(np.sort(got.ids, 1), np.sort(seq.ids, 1))
        assert np.abs(_by_id(got.ids, got.logprobs) - _by_id(seq.ids, seq.logprobs)).max() < 0.5
        assert np.all(np.diff(got.logprobs, axis=1) <= 0) and got.token_offset == 5 * s


def test_per_token_scale_keeps_far_down_entries_at_their_depth():
    """A sharp row (entries 40-60 nats below the top-1) keeps its depth; a normal row keeps scale COMPAND."""
    lp = np.array([[-1e-6, -40.0, -52.0, -60.0], [-0.5, -1.5, -2.0, -4.0]])
    scales = codec.row_scales(lp)
    assert (
        scales.dtype == np.float16
        and scales[1] == codec.COMPAND
        and scales[0] * np.log(255) >= 60.0
    )
    mass = np.log(np.exp(lp).sum(1))
    decoded = codec.dequantise_logprobs(codec.quantise_logprobs(lp, scales), mass, scales).astype(
        np.float64
    )
    assert np.abs(decoded[0] - lp[0]).max() < 1.0 and np.abs(decoded[1] - lp[1]).max() < 0.02
    # version 1: one fixed scale
    clamped = codec.dequantise_logprobs(codec.quantise_logprobs(lp), mass)
    assert clamped[0, -1] > -17.0


def _by_id(ids: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """Each row's log-probs in id order (rows that hold the same ids then compare entry by entry)."""
    return np.take_along_axis(lp, np.argsort(ids, 1), 1)
