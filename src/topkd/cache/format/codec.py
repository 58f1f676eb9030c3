"""Bit-level codecs of the top-K cache: id packing, Rice-coded id gaps, log-prob quantisation.

Pure numpy, vectorised over all tokens of a sequence; docs/cache-format.md is the prose spec
and tests/cache/test_codec.py pins it. Two id codecs:

- "packed": each id in ceil(log2 V) bits, in the teacher's rank order (descending log-prob).
  Fixed bytes per token; any V up to 2^32.
- "rice" (and "rice-zstd", the default: the same bytes in one zstd frame per sequence; the codec table is
  topkd/cache/format/shard_codecs.py): ids sorted ascending, gaps g_0 = id_0, g_i = id_i - id_{i-1} - 1 Rice-coded
  with one parameter b per shard: the low b bits of each gap bit-packed at a fixed width, the
  high part (g >> b) in unary (that many 1 bits, then a 0) in a per-sequence bit stream.
  Top-K ids of real teachers cluster (frequent tokens, similar tokens), so gaps are small.

Log-probs are stored as one uint8 code per entry on a companded scale of the gap below the
top-1, d = a_max - a_k >= 0:  u = 1 - exp(-d / s), code = min(round(255 u), 254), with a
per-token scale s = max(COMPAND, d_max / ln 255) (float16), so the lowest entry of the row is
never clamped: a sharp teacher's far-down entries keep their true depth, which tempered targets
(a / T) need. Steps are fine where the mass is (0.008 nats at the top) and coarse where it is
not, which spreads the KL cost of rounding evenly over the K entries; the decoder renormalises
the entries to the exact top-K mass stored per token, so the mass split with the tail is exact.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

# format version 4: an entry that is padding (a row of variable K); its id is never read
PAD_CODE = 255
# nats: the smallest per-token scale; code 254 then decodes to 16.6 nats below the top-1
COMPAND = 3.0
MAX_SCALE = 4096.0  # largest scale (float16-exact); rows deeper than 4096 ln 255 nats (e.g. -inf entries) clamp
MAX_CODE = 254


def id_bits(vocab: int) -> int:
    """Bits per id for the packed codec: ceil(log2 V), at least 1."""
    if vocab < 1:
        raise ValueError(f"vocab: expected >= 1, got {vocab}")
    return max(1, (vocab - 1).bit_length())


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """[T, K] non-negative ints < 2^width -> [T, ceil(K width / 8)] uint8, little-endian bit order."""
    if width == 0:
        return np.zeros((values.shape[0], 0), dtype=np.uint8)
    v = values.astype(np.uint64, copy=False)
    shifts = np.arange(width, dtype=np.uint64)
    bits = ((v[..., None] >> shifts) & np.uint64(1)).astype(np.uint8)  # [T, K, width]
    return np.packbits(bits.reshape(values.shape[0], -1), axis=1, bitorder="little")


def unpack_bits(packed: np.ndarray, k: int, width: int) -> np.ndarray:
    """Inverse of pack_bits: [T, ceil(K width / 8)] uint8 -> [T, K] int64."""
    if width == 0:
        return np.zeros((packed.shape[0], k), dtype=np.int64)
    if width in (8, 16):  # whole bytes: the little-endian bit order is the little-endian byte order
        return (
            np.ascontiguousarray(packed)
            .view("<u1" if width == 8 else "<u2")[:, :k]
            .astype(np.int64)
        )
    bits = np.unpackbits(packed, axis=1, count=k * width, bitorder="little").reshape(
        packed.shape[0], k, width
    )
    weights = np.int64(1) << np.arange(width, dtype=np.int64)
    return bits.astype(np.int64) @ weights


def id_gaps(sorted_ids: np.ndarray) -> np.ndarray:
    """Ascending distinct ids [T, K] -> gaps >= 0 (first id, then distance - 1)."""
    gaps = np.diff(sorted_ids, axis=1, prepend=-1) - 1
    if gaps.size and gaps.min() < 0:
        raise ValueError(
            "teacher ids: expected K distinct ids per token, got a repeated id; "
            "top-K ids from torch.topk are always distinct, check the producer"
        )
    return gaps


MAX_RICE_PARAMETER = 32  # a gap is below V < 2^32: no larger parameter is ever best


def best_rice_parameter(gaps: np.ndarray) -> int:
    """The b minimising the exact Rice size sum((g >> b) + 1 + b) over these gaps."""
    if gaps.size == 0:
        return 0
    top = int(gaps.max()).bit_length()
    sizes = [int((gaps >> b).sum()) + gaps.size * (1 + b) for b in range(top + 1)]
    return int(np.argmin(sizes))


def encode_unary(quotients: np.ndarray) -> np.ndarray:
    """1-D quotients -> packed bit stream: q ones then a zero each, little-endian bits, zero padded."""
    q = quotients.reshape(-1).astype(np.int64)
    bits = np.ones(int(q.sum()) + q.size, dtype=np.uint8)
    bits[np.cumsum(q + 1) - 1] = 0
    return np.packbits(bits, bitorder="little")


def decode_unary(stream: np.ndarray, count: int) -> np.ndarray:
    """First `count` unary codes of a packed bit stream -> int64 quotients."""
    zeros = np.flatnonzero(np.unpackbits(stream, bitorder="little") == 0)[:count]
    if zeros.size != count:
        raise ValueError(
            f"unary stream: expected {count} codes, found {zeros.size}; the shard is corrupt"
        )
    return np.diff(zeros, prepend=-1) - 1


def sorted_gaps(
    ids: np.ndarray, padding: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Ids [T, K] (any order) -> (the permutation sorting each row ascending, the gaps of the sorted rows).
    padding [T, K] (format 4): those entries sort last with gap 0 each, the cheapest Rice code."""
    if padding is None or not padding.any():
        order = np.argsort(ids, axis=1, kind="stable")
        return order, id_gaps(np.take_along_axis(ids, order, axis=1).astype(np.int64))
    key = np.where(padding, np.iinfo(np.int64).max, ids.astype(np.int64))
    order = np.argsort(key, axis=1, kind="stable")
    ranked = np.take_along_axis(key, order, axis=1)
    pad = np.take_along_axis(padding, order, axis=1)
    # each padding follows the last real id
    last = np.maximum.accumulate(np.where(pad, -1, ranked), axis=1)
    ranked = np.where(pad, last + np.cumsum(pad, axis=1), ranked)
    return order, id_gaps(ranked)


def encode_rice(gaps: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaps [T, K] -> (low b bits bit-packed [T, bytes], high parts as one unary stream)."""
    return pack_bits(gaps & ((1 << b) - 1), b), encode_unary(gaps >> b)


def decode_rice(remainders: np.ndarray, stream: np.ndarray, k: int, b: int) -> np.ndarray:
    """Inverse of encode_rice: ascending ids [T, K] int64."""
    t = remainders.shape[0]
    quotients = decode_unary(stream, t * k).reshape(t, k)
    gaps = (quotients << b) | unpack_bits(remainders, k, b)
    return np.cumsum(gaps + 1, axis=1) - 1


def row_scales(logprobs: np.ndarray) -> np.ndarray:
    """Per-row compander scale [T] float16: COMPAND, or wider so the row's lowest entry decodes at its depth."""
    lp = logprobs.astype(np.float64)
    # -inf entries (masked logits) clamp to the last code
    finite = np.where(np.isfinite(lp), lp, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-masked row has no depth: 0
        depth = (
            np.nan_to_num(np.nanmax(finite, axis=1) - np.nanmin(finite, axis=1))
            if lp.size
            else np.zeros(lp.shape[0])
        )
    scale = np.clip(depth / math.log(MAX_CODE + 1), COMPAND, MAX_SCALE)
    half = scale.astype(np.float16)
    # rounded up: nothing clamps
    return np.where(half < scale, np.nextafter(half, np.float16(np.inf)), half)


def quantise_logprobs(
    logprobs: np.ndarray, scales: np.ndarray | None = None, padding: np.ndarray | None = None
) -> np.ndarray:
    """[T, K] float log-probs (any order) -> uint8 codes of the companded gap below each row's max.

    scales: per-row compander scale (row_scales); None means COMPAND for every row (format version 1).
    padding [T, K] (format 4): those entries get PAD_CODE, whatever their log-prob."""
    lp = logprobs.astype(np.float64)
    if padding is not None:
        lp = np.where(padding, np.nan, lp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        d = (
            np.nanmax(lp, axis=1, keepdims=True) - lp
            if padding is not None
            else lp.max(axis=1, keepdims=True) - lp
        )
    s = COMPAND if scales is None else scales.astype(np.float64)[:, None]
    u = -np.expm1(-d / s)
    codes = np.minimum(np.rint(np.nan_to_num(u) * (MAX_CODE + 1)), MAX_CODE).astype(np.uint8)
    return codes if padding is None else np.where(padding, PAD_CODE, codes).astype(np.uint8)


# d / scale per code
_UNIT_DEPTH = np.array([-math.log1p(-c / (MAX_CODE + 1)) for c in range(MAX_CODE + 1)])
# PAD_CODE: infinitely deep, exp 0: no share of the mass
_UNIT_DEPTH_PAD = np.append(_UNIT_DEPTH, np.inf)


def dequantise_logprobs(
    codes: np.ndarray,
    log_mass: np.ndarray,
    scales: np.ndarray | None = None,
    padding_allowed: bool = False,
) -> np.ndarray:
    """uint8 codes [T, K] + exact log top-K mass [T] (+ per-row scales) -> float32 log-probs with that exact mass.
    padding_allowed (format 4): PAD_CODE decodes to -inf, outside the mass."""
    top = MAX_CODE + 1 if padding_allowed else MAX_CODE
    if codes.size and codes.max() > top:
        raise ValueError(
            f"log-prob codes: expected 0..{top}, got {int(codes.max())}; the shard is corrupt"
        )
    s = COMPAND if scales is None else scales.astype(np.float64)[:, None]
    neg_d = -_UNIT_DEPTH_PAD[codes] * s
    shift = np.log(np.exp(neg_d).sum(axis=1, keepdims=True))  # max entry is 0, so no overflow
    return (neg_d - shift + log_mass.astype(np.float64)[:, None]).astype(np.float32)


# Format version 5 (rows of variable K stored ragged, codec rice-zstd): each row holds only its real entries.
RAGGED_POSITIONS = 8  # a gap's Rice context: its row width's bit length and its relative place in the row, in eighths


def bit_length(values: np.ndarray) -> np.ndarray:
    """Elementwise int.bit_length of non-negative ints < 2^62."""
    return np.searchsorted(np.int64(1) << np.arange(63, dtype=np.int64), values, side="right")


def ragged_positions(widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of these widths flattened in row order -> (row of each entry, index of each entry in its row)."""
    widths = widths.astype(np.int64)
    row = np.repeat(np.arange(widths.size), widths)
    return row, np.arange(row.size) - np.repeat(np.cumsum(widths) - widths, widths)


def gap_contexts(widths: np.ndarray) -> np.ndarray:
    """The Rice context of each entry of ragged rows: RAGGED_POSITIONS * bitlen(k) + RAGGED_POSITIONS i // k.
    Gaps early in a row (frequent tokens have low ids) are shorter than late ones, and narrow rows' gaps are long:
    one Rice parameter per context is ~13% smaller than one per shard on sampled SmolLM2 rows."""
    row, i = ragged_positions(widths)
    k = widths.astype(np.int64)[row]
    return bit_length(k) * RAGGED_POSITIONS + (RAGGED_POSITIONS * i) // np.maximum(k, 1)


def context_count(max_width: int) -> int:
    return (int(max_width).bit_length() + 1) * RAGGED_POSITIONS


def best_context_parameters(gaps: np.ndarray, contexts: np.ndarray, n_contexts: int) -> list[int]:
    """The Rice parameter of each context minimising its exact coded size (0 for contexts never seen)."""
    return [best_rice_parameter(gaps[contexts == c]) for c in range(n_contexts)]


def pack_varwidth(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """1-D non-negative ints, value i in widths[i] bits -> one little-endian bit stream, zero padded to a byte."""
    owner, bit = ragged_positions(widths)
    return np.packbits(
        ((values.astype(np.int64)[owner] >> bit) & 1).astype(np.uint8), bitorder="little"
    )


def unpack_varwidth(stream: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Inverse of pack_varwidth (widths <= 56): int64 values, each read from the 8 bytes starting at its first
    bit's byte (one gather per value, not one per bit)."""
    widths = widths.astype(np.int64)
    total = int(widths.sum())
    if stream.size * 8 < total:
        raise ValueError(
            f"remainder stream: expected {total} bits, got {stream.size * 8}; the shard is corrupt"
        )
    start = np.cumsum(widths) - widths
    padded = np.concatenate([stream, np.zeros(8, np.uint8)])
    # 8 bytes from each byte
    at_byte = np.ndarray((stream.size + 1,), dtype="<u8", buffer=padded, strides=(1,))
    window = at_byte[start >> 3]
    mask = (np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1)
    return ((window >> (start & 7).astype(np.uint64)) & mask).astype(np.int64)


def entry_bits(widths: np.ndarray, parameters: list[int]) -> np.ndarray:
    """The Rice parameter of every entry of ragged rows of these widths (its context's, codec.gap_contexts)."""
    return np.asarray(parameters, dtype=np.int64)[gap_contexts(widths)]


def encode_rice_ragged(gaps: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat gaps of ragged rows, each with its Rice parameter (entry_bits) -> (low bits, one stream; unary)."""
    return pack_varwidth(gaps & ((np.int64(1) << bits) - 1), bits), encode_unary(gaps >> bits)


def decode_rice_ragged(
    remainders: np.ndarray, stream: np.ndarray, widths: np.ndarray, bits: np.ndarray
) -> np.ndarray:
    """Inverse of encode_rice_ragged: the flat ascending ids of each row, row after row."""
    gaps = (decode_unary(stream, int(widths.sum())) << bits) | unpack_varwidth(remainders, bits)
    ends = np.concatenate([[0], np.cumsum(gaps + 1)])
    starts = np.cumsum(widths.astype(np.int64)) - widths
    return ends[1:] - np.repeat(ends[starts], widths) - 1
