"""The shard codecs as one table: name -> the tensors it writes, how it encodes, how it decodes.

    CODECS["rice-zstd"].encode(ids, logprobs, scales, rows, vocab, padding)  -> (arrays, meta)
    CODECS[name].decode(reader, j, a, e, log_mass)                  -> (ids, logprobs) in rank order

padding [T, K] (format version 4, rows of variable K): those entries get the log-prob code PAD_CODE and decode
to -inf, last in rank order, their id the row's first (never read); the rice codecs give them gap 0.

Adding a codec is one class here (and its section in docs/cache-format.md, and its golden bytes in
tests/cache/test_golden.py); shard.py and reader.py only look codecs up. The bit-level pieces
(packing, Rice coding, log-prob companding) are in topkd/cache/format/codec.py.
"""

from __future__ import annotations

import numpy as np

from topkd.cache.format import codec, ragged

# zstd level of the rice-zstd frames: 3 is within 3% of level 19 on these bytes, and fast
ZSTD_LEVEL = 3


class Packed:
    """Each id in ceil(log2 V) bits, in the teacher's rank order; fixed bytes per token."""

    name = "packed"
    tensors = frozenset({"lp_scale", "lp_codes", "ids_packed"})
    stores_ragged = False  # rows of variable K: padded (version 4)
    meta_keys = ()  # header fields its decode reads beyond k and vocab

    def encode(
        self, ids, logprobs, scales, rows, vocab, padding=None, samples=None, ragged_rows=False
    ):
        stored = ids if padding is None else np.where(padding, 0, ids)
        return {
            "lp_scale": scales,
            "ids_packed": codec.pack_bits(stored, codec.id_bits(vocab)),
            "lp_codes": codec.quantise_logprobs(logprobs, scales, padding),
        }, {}

    def decode(self, reader, j: int, a: int, e: int, log_mass):
        logprobs = codec.dequantise_logprobs(
            reader.rows("lp_codes", a, e),
            log_mass,
            reader.rows("lp_scale", a, e),
            padding_allowed=reader.variable_k,
        )
        ids = codec.unpack_bits(
            reader.rows("ids_packed", a, e), reader.k, codec.id_bits(reader.vocab)
        )
        return _ranked(ids, logprobs, reader.variable_k)


class Rice:
    """Ids sorted ascending, gaps Rice-coded with one parameter b per shard (low bits fixed-width, high parts in
    a unary stream per sequence); log-prob codes follow the sorted order."""

    name = "rice"
    tensors = frozenset({"lp_scale", "lp_codes", "id_rem", "id_unary", "unary_offsets"})
    meta_keys = ("rice_b",)  # header fields its decode reads (a ragged shard's are ragged.py's)
    stores_ragged = False

    def encode(
        self, ids, logprobs, scales, rows, vocab, padding=None, samples=None, ragged_rows=False
    ):
        order, gaps = codec.sorted_gaps(ids, padding)
        sorted_padding = None if padding is None else np.take_along_axis(padding, order, axis=1)
        b = codec.best_rice_parameter(gaps)
        # one unary stream per sequence
        parts = [codec.encode_rice(gaps[a:e], b) for a, e in zip(rows, rows[1:])]
        streams = [p[1] for p in parts]
        arrays = {
            "lp_scale": scales,
            "id_rem": np.concatenate([p[0] for p in parts]),
            "id_unary": np.concatenate(streams),
            "unary_offsets": np.concatenate([[0], np.cumsum([len(s) for s in streams])]).astype(
                np.int64
            ),
            "lp_codes": codec.quantise_logprobs(
                np.take_along_axis(logprobs, order, axis=1), scales, sorted_padding
            ),
        }
        return arrays, {"rice_b": str(b)}

    def decode(self, reader, j: int, a: int, e: int, log_mass):
        scales, lp_codes, remainders, unary = self.parts(reader, j, a, e)
        ids = codec.decode_rice(remainders, unary, reader.k, int(reader.meta["rice_b"]))
        # a row's codes ascend as its log-probs descend (one scale per row); a stable sort of uint8 is a radix
        # sort, ~4x faster than sorting the floats; ties keep ascending id order
        rank = np.argsort(lp_codes, axis=1, kind="stable")
        logprobs = codec.dequantise_logprobs(
            np.take_along_axis(lp_codes, rank, 1),
            log_mass,
            scales,
            padding_allowed=reader.variable_k,
        )
        return _ranked(np.take_along_axis(ids, rank, 1), logprobs, reader.variable_k)

    def parts(self, reader, j: int, a: int, e: int) -> tuple[np.ndarray, ...]:
        """(lp_scale [n], lp_codes [n, K], id_rem [n, bytes], unary stream) of sequence j, rows [a, e)."""
        offsets = reader.offsets("unary_offsets")
        ua, ue = int(offsets[j]), int(offsets[j + 1])
        return (
            reader.rows("lp_scale", a, e),
            reader.rows("lp_codes", a, e),
            reader.rows("id_rem", a, e),
            reader.rows("id_unary", ua, ue),
        )


class RiceZstd(Rice):
    """rice's bytes, one zstd frame per sequence (lp_scale as little-endian float16, lp_codes, id_rem, unary
    bytes, in that order): random access kept, ~10% smaller. The default."""

    name = "rice-zstd"
    tensors = frozenset({"zstd_frames", "frame_offsets"})
    stores_ragged = (
        True  # rows of variable K: only their real entries (version 5, cache/format/ragged.py)
    )

    def encode(
        self, ids, logprobs, scales, rows, vocab, padding=None, samples=None, ragged_rows=False
    ):
        import zstandard

        if ragged_rows:
            return ragged.encode(ids, logprobs, scales, rows, padding, samples)

        arrays, meta = super().encode(ids, logprobs, scales, rows, vocab, padding)
        scale, lp, rem, unary = (arrays[n] for n in ("lp_scale", "lp_codes", "id_rem", "id_unary"))
        scale, uoff = scale.astype("<f2"), arrays["unary_offsets"]
        compressor = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=True, write_content_size=True
        )
        frames = [
            compressor.compress(
                scale[a:e].tobytes()
                + lp[a:e].tobytes()
                + rem[a:e].tobytes()
                + unary[ua:ue].tobytes()
            )
            for a, e, ua, ue in zip(rows, rows[1:], uoff, uoff[1:])
        ]
        return {
            "zstd_frames": np.frombuffer(b"".join(frames), dtype=np.uint8),
            "frame_offsets": np.concatenate([[0], np.cumsum([len(f) for f in frames])]).astype(
                np.int64
            ),
        }, meta

    def decode(self, reader, j: int, a: int, e: int, log_mass):
        return (
            ragged.decode(reader, j, a, e, log_mass)
            if reader.ragged
            else super().decode(reader, j, a, e, log_mass)
        )

    def parts(self, reader, j: int, a: int, e: int) -> tuple[np.ndarray, ...]:
        import zstandard

        offsets = reader.offsets("frame_offsets")
        fa, fe = int(offsets[j]), int(offsets[j + 1])
        try:
            raw = np.frombuffer(
                zstandard.ZstdDecompressor().decompress(
                    reader.rows("zstd_frames", fa, fe).tobytes()
                ),
                dtype=np.uint8,
            )
        except zstandard.ZstdError as err:
            raise ValueError(
                f"{reader.path}: zstd frame of sequence {j} does not decode ({err}); the shard is corrupt"
            )
        n, width = e - a, (reader.k * int(reader.meta["rice_b"]) + 7) // 8
        sizes = [2 * n, n * reader.k, n * width]
        if raw.size < sum(sizes):
            raise ValueError(
                f"{reader.path}: zstd frame of sequence {j} is {raw.size} bytes, expected at least "
                f"{sum(sizes)}; the shard is corrupt"
            )
        scale, lp, rem, unary = np.split(raw, np.cumsum(sizes))
        return scale.view("<f2"), lp.reshape(n, reader.k), rem.reshape(n, width), unary


def _ranked(ids: np.ndarray, logprobs: np.ndarray, variable_k: bool):
    """Rank order in, rank order out; padding (-inf, last) gets the row's first id, a valid id never read."""
    if variable_k:
        ids = np.where(np.isneginf(logprobs), ids[:, :1], ids)
    return ids, logprobs


CODECS = {c.name: c for c in (RiceZstd(), Rice(), Packed())}
DEFAULT_CODEC = RiceZstd.name  # what a build writes unless --codec says otherwise


def lookup(name: str, where: str = "codec") -> Rice | Packed:
    if name not in CODECS:
        raise ValueError(f"{where}: expected one of {tuple(CODECS)}, got {name!r}")
    return CODECS[name]
