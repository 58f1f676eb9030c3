"""Cache format version 5: rows of variable K stored ragged, each row only its real entries (codec rice-zstd).

    arrays, meta = encode(ids, logprobs, scales, rows, padding, samples=50)   # padding [T, K]: entries not stored
    ids, logprobs = decode(reader, j, a, e, log_mass)   # [n, K] again: rank order, padding -inf last

Per sequence one zstd frame (level 3, checksum, content size) of, in this order: the rows' compander scales
(float16, only when the values are log-prob codes), the row widths (uint8, or little-endian uint16 when K > 255),
the values of the real entries in ascending-id order (uint8 each: draw counts 1..N for sampled targets, so the
targets are exactly count / N; log-prob codes otherwise), the low bits of the id gaps (one bit stream, each gap at
its context's Rice parameter: codec.gap_contexts), then the unary high parts. docs/cache-format.md is the spec.
"""

from __future__ import annotations

import numpy as np

from topkd.cache.format import codec

ZSTD_LEVEL = 3


def encode(
    ids: np.ndarray,
    logprobs: np.ndarray,
    scales: np.ndarray,
    rows: np.ndarray,
    padding: np.ndarray,
    samples: int | None,
) -> tuple[dict, dict]:
    """Padded rows [T, K] -> (zstd_frames, frame_offsets) and the shard's meta (values, samples, rice_b_table)."""
    import zstandard

    # padding sorts last, so each row's real entries come first
    order, gaps = codec.sorted_gaps(ids, padding)
    real = ~np.take_along_axis(padding, order, axis=1)
    widths = real.sum(axis=1)
    sorted_lp = np.take_along_axis(logprobs, order, axis=1)
    values = (
        count_codes(sorted_lp[real], samples)
        if samples
        else codec.quantise_logprobs(sorted_lp, scales, ~real)[real]
    )
    flat_gaps = gaps[real]
    table = codec.best_context_parameters(
        flat_gaps, codec.gap_contexts(widths), codec.context_count(ids.shape[1])
    )
    width_dtype = "<u2" if ids.shape[1] > 255 else np.uint8
    entry = np.concatenate([[0], np.cumsum(widths)])
    compressor = zstandard.ZstdCompressor(
        level=ZSTD_LEVEL, write_checksum=True, write_content_size=True
    )
    frames = []
    for a, e in zip(rows, rows[1:]):
        ea, ee = entry[a], entry[e]
        rem, unary = codec.encode_rice_ragged(
            flat_gaps[ea:ee], codec.entry_bits(widths[a:e], table)
        )
        # one sequence's frame: [scales,] widths, values, Rice remainders, unary parts
        parts = [widths[a:e].astype(width_dtype), values[ea:ee], rem, unary]
        if not samples:
            parts.insert(0, scales[a:e].astype("<f2"))
        frames.append(compressor.compress(b"".join(p.tobytes() for p in parts)))
    meta = {
        "values": "counts" if samples else "logprobs",
        "rice_b_table": ",".join(map(str, table)),
    }
    if samples:
        meta["samples"] = str(samples)
    return {
        "zstd_frames": np.frombuffer(b"".join(frames), dtype=np.uint8),
        "frame_offsets": np.concatenate([[0], np.cumsum([len(f) for f in frames])]).astype(
            np.int64
        ),
    }, meta


def count_codes(logprobs: np.ndarray, samples: int) -> np.ndarray:
    """Sampled targets' log(count / N) -> the counts as uint8, refusing anything that is not exactly such a value."""
    if not 1 <= samples <= 255:
        raise ValueError(
            f"sampled targets: expected 1 <= samples <= 255 to store counts in a byte, got {samples}"
        )
    counts = np.rint(np.exp(logprobs.astype(np.float64)) * samples)
    exact = np.log(np.maximum(counts, 1) / samples).astype(np.float32) == logprobs
    if logprobs.size and (counts.min() < 1 or not exact.all()):
        raise ValueError(
            f"sampled targets: expected every log-prob to be log(count / {samples}) with a count in "
            f"1..{samples}; these rows are not draw counts (build them with --targets sampled)"
        )
    return counts.astype(np.uint8)


def decode(reader, j: int, a: int, e: int, log_mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequence j (rows [a, e)) back to padded [n, K] rows in rank order: ids, log-probs (-inf padding, last)."""
    n, k = e - a, reader.k
    scales, widths, bits, values, rem, unary = _frame_parts(reader, j, n)
    row, col = codec.ragged_positions(widths)
    ids = np.zeros((n, k), np.int64)
    ids[row, col] = codec.decode_rice_ragged(rem, unary, widths, bits)
    samples = reader.samples
    key = np.full((n, k), samples or codec.PAD_CODE, np.uint8)  # padding's key sorts last
    key[row, col] = samples - values if samples else values  # ascending key = descending target
    rank = np.argsort(key, axis=1, kind="stable")  # ties keep ascending id order
    ids, key = np.take_along_axis(ids, rank, axis=1), np.take_along_axis(key, rank, axis=1)
    if samples:
        with np.errstate(divide="ignore"):  # key N: count 0, padding: -inf
            # key -> log((N - key) / N)
            table = np.log(np.arange(samples, -1, -1) / samples).astype(np.float32)
        logprobs = table[key]
    else:
        logprobs = codec.dequantise_logprobs(key, log_mass, scales, padding_allowed=True)
    return np.where(np.isneginf(logprobs), ids[:, :1], ids), logprobs


def _frame_parts(reader, j: int, n: int) -> tuple[np.ndarray | None, ...]:
    """(scales or None, widths, entry bits, values, remainder stream, unary stream) of sequence j's frame, sizes
    checked."""
    import zstandard

    offsets = reader.offsets("frame_offsets")
    fa, fe = int(offsets[j]), int(offsets[j + 1])
    where = f"{reader.path}: zstd frame of sequence {j}"
    try:
        raw = np.frombuffer(
            zstandard.ZstdDecompressor().decompress(reader.rows("zstd_frames", fa, fe).tobytes()),
            dtype=np.uint8,
        )
    except zstandard.ZstdError as err:
        raise ValueError(f"{where} does not decode ({err}); the shard is corrupt")
    head, width_bytes = 0 if reader.samples else 2 * n, 2 if reader.k > 255 else 1
    if raw.size < head + width_bytes * n:
        raise ValueError(
            f"{where} is {raw.size} bytes, too short for {n} rows; the shard is corrupt"
        )
    scales = raw[:head].view("<f2") if head else None
    widths = (
        raw[head : head + width_bytes * n]
        .view("<u2" if width_bytes == 2 else np.uint8)
        .astype(np.int64)
    )
    entries = int(widths.sum())
    # every row keeps at least its top entry (top-p: --min-k >= 1; draws: N >= 1)
    if widths.size and widths.min() < 1:
        raise ValueError(
            f"{where}: row {int(np.argmin(widths))} holds no entry; the shard is corrupt"
        )
    if widths.size and widths.max() > reader.k:
        raise ValueError(
            f"{where}: a row holds {int(widths.max())} entries, more than K={reader.k}; the shard is "
            "corrupt"
        )
    start = head + width_bytes * n
    bits = codec.entry_bits(widths, reader.rice_table)
    rem_bytes = (int(bits.sum()) + 7) // 8
    values, rest = raw[start : start + entries], raw[start + entries :]
    if values.size < entries or rest.size < rem_bytes:
        raise ValueError(
            f"{where} is {raw.size} bytes, too short for its {entries} entries; the shard is corrupt"
        )
    _check_counts(values, widths, reader.samples, where)
    return scales, widths, bits, values, rest[:rem_bytes], rest[rem_bytes:]


def _check_counts(values: np.ndarray, widths: np.ndarray, samples: int | None, where: str) -> None:
    """Counts are 1..N and sum to N in every row; log-prob codes stop at codec.MAX_CODE."""
    if not samples:
        if values.size and values.max() > codec.MAX_CODE:
            raise ValueError(
                f"{where}: log-prob code {int(values.max())} > {codec.MAX_CODE}; the shard is corrupt"
            )
        return
    row, _ = codec.ragged_positions(widths)
    sums = np.bincount(row, weights=values, minlength=widths.size)
    if (values.size and values.min() < 1) or (sums != samples).any():
        raise ValueError(
            f"{where}: draw counts must be >= 1 and sum to {samples} in every row; the shard is corrupt"
        )
