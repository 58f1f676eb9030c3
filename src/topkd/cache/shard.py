"""One cache shard: consecutive sequences encoded into a safetensors file, and decoded back.

    arrays, meta = encode_shard(sequences, vocab=V, codec_name="rice-zstd", identity={"build_hash": h, ...})
    write_shard(path, arrays, meta)            # temp file, fsync, rename: never half-written
    seq = ShardReader(path).sequence(j)        # j-th sequence of the shard, as numpy arrays

docs/cache-format.md describes every tensor; tests/cache/test_golden.py pins the bytes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from topkd.cache import codec
from topkd.files import write_atomic

FORMAT_VERSION = 2  # 2: per-token compander scale, exact tempered head mass, shard identity in meta_json
CODECS = ("rice-zstd", "rice", "packed")
ZSTD_LEVEL = 3  # zstd level of the rice-zstd frames: 3 is within 3% of level 19 on these bytes, and fast


@dataclass
class TeacherSequence:
    """The teacher's top-K output for one sequence; row t holds p(x_{t+1} | x_<=t)."""

    input_ids: np.ndarray  # [L] int
    ids: np.ndarray  # [L, K] int, rank order (descending log-prob)
    logprobs: np.ndarray  # [L, K] float32, sorted descending, normalised over the full vocabulary
    log_mass: np.ndarray  # [L] float32, log of the top-K mass
    log_tail: np.ndarray  # [L] float32, log of the mass outside the top-K (-inf when K = V)
    logz: np.ndarray  # [L, n_temperatures] float32, c_T = log sum_v exp(a_v / T)
    doc_starts: np.ndarray  # positions in [0, L) where a document begins
    source_index: int = 0  # index of the sequence in the source data
    token_offset: int = 0  # offset of its first token in the source token stream
    log_mass_t: np.ndarray | None = None  # [L, n_temperatures] float32, log sum_k exp(a_k / T - c_T), exact
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def encode_shard(seqs: list[TeacherSequence], *, vocab: int, codec_name: str = "rice-zstd",
                 identity: dict | None = None, temperatures: tuple[float, ...] = ()) -> tuple[dict, dict]:
    """Sequences -> (tensor name -> numpy array, string metadata) for one shard.

    identity (build_hash, shard, sequences) goes into the checksummed bytes, so a shard moved in from
    another cache or position is refused by the reader; temperatures name the columns of logz."""
    if codec_name not in CODECS:
        raise ValueError(f"codec: expected one of {CODECS}, got {codec_name!r}")
    if not seqs:
        raise ValueError("a shard needs at least one sequence, got none")
    cat = lambda name: np.concatenate([getattr(s, name) for s in seqs])  # noqa: E731
    ids, logprobs, k = cat("ids").astype(np.int64), cat("logprobs"), seqs[0].ids.shape[1]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    rows = np.concatenate([[0], np.cumsum(lengths)])
    logz = cat("logz").astype(np.float32).reshape(len(ids), -1)
    if logz.shape[1] != len(temperatures):
        raise ValueError(f"logz: expected one column per temperature {list(temperatures)}, got {logz.shape[1]}")
    scales = codec.row_scales(logprobs)
    arrays = {
        "input_ids": cat("input_ids").astype(np.int32),
        "log_mass": cat("log_mass").astype(np.float32),
        "log_tail": cat("log_tail").astype(np.float32),
        "logz": logz,
        "log_mass_t": _tempered_masses(seqs, logz.shape[1]),
        "lp_scale": scales,
        "seq_rows": rows,
        "seq_source": np.array([s.source_index for s in seqs], dtype=np.int64),
        "seq_token_offset": np.array([s.token_offset for s in seqs], dtype=np.int64),
        "doc_starts": np.concatenate([s.doc_starts.astype(np.int64) + r for s, r in zip(seqs, rows)]),
    }
    meta = {"format_version": str(FORMAT_VERSION), "codec": codec_name, "k": str(k), "vocab": str(vocab),
            "temperatures": json.dumps([float(t) for t in temperatures])}
    meta.update({key: str(value) for key, value in (identity or {}).items()})
    if codec_name == "packed":
        arrays["ids_packed"] = codec.pack_bits(ids, codec.id_bits(vocab))
        arrays["lp_codes"] = codec.quantise_logprobs(logprobs, scales)
        return arrays, meta
    order, gaps = codec.sorted_gaps(ids)
    b = codec.best_rice_parameter(gaps)
    parts = [codec.encode_rice(gaps[a:e], b) for a, e in zip(rows, rows[1:])]  # one unary stream per sequence
    streams = [p[1] for p in parts]
    arrays["id_rem"] = np.concatenate([p[0] for p in parts])
    arrays["id_unary"] = np.concatenate(streams)
    arrays["unary_offsets"] = np.concatenate([[0], np.cumsum([len(s) for s in streams])]).astype(np.int64)
    arrays["lp_codes"] = codec.quantise_logprobs(np.take_along_axis(logprobs, order, axis=1), scales)
    meta["rice_b"] = str(b)
    if codec_name == "rice-zstd":
        _zstd_frames(arrays, rows)
    return arrays, meta


def _tempered_masses(seqs: list[TeacherSequence], n_temperatures: int) -> np.ndarray:
    """log_mass_t of every row: the exact tempered top-K mass the reader renormalises the decoded head to."""
    parts = []
    for s in seqs:
        if s.log_mass_t is None and n_temperatures:
            raise ValueError("log_mass_t: expected the exact tempered top-K mass per stored temperature, got None")
        parts.append(np.zeros((len(s), 0), np.float32) if s.log_mass_t is None else s.log_mass_t)
    return np.concatenate(parts).astype(np.float32).reshape(sum(len(s) for s in seqs), n_temperatures)


def _zstd_frames(arrays: dict, rows: np.ndarray) -> None:
    """rice-zstd: per sequence, one zstd frame of its lp_scale, lp_codes, id_rem and unary bytes (random access
    kept; the scales are nearly all equal, so inside the frame they cost almost nothing)."""
    import zstandard

    names = ("lp_scale", "lp_codes", "id_rem", "id_unary", "unary_offsets")
    scale, lp, rem, unary, uoff = (arrays.pop(n) for n in names)
    scale = scale.astype("<f2")
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    frames = [compressor.compress(scale[a:e].tobytes() + lp[a:e].tobytes() + rem[a:e].tobytes() +
                                  unary[ua:ue].tobytes())
              for a, e, ua, ue in zip(rows, rows[1:], uoff, uoff[1:])]
    arrays["zstd_frames"] = np.frombuffer(b"".join(frames), dtype=np.uint8)
    arrays["frame_offsets"] = np.concatenate([[0], np.cumsum([len(f) for f in frames])]).astype(np.int64)


def write_shard(path: str, arrays: dict, meta: dict) -> int:
    """Write atomically (temp file, fsync, rename); returns the byte size.

    The string metadata goes in as a `meta_json` uint8 tensor of sorted-key JSON, because
    safetensors serialises its own __metadata__ map in hash order: bytes would differ per run."""
    meta_bytes = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    data = save({**arrays, "meta_json": meta_bytes})
    write_atomic(path, data)
    return len(data)


def read_meta(path: str) -> dict:
    """A shard's meta_json (format version, codec, identity) without reading anything else."""
    with safe_open(path, framework="np") as f:
        return json.loads(f.get_tensor("meta_json").tobytes())


class ShardReader:
    """Lazy, memory-mapped access to one shard; re-opens itself after a fork (DataLoader workers)."""

    def __init__(self, path: str):
        self.path = path
        self._pid, self._file = None, None
        f = self._handle()
        self.meta = json.loads(f.get_tensor("meta_json").tobytes())
        self.names = set(f.keys()) - {"meta_json"}
        self.seq_rows = f.get_tensor("seq_rows")
        self.k, self.codec = int(self.meta["k"]), self.meta["codec"]
        self.temperatures = [float(t) for t in json.loads(self.meta.get("temperatures", "[]"))]
        self.unary_offsets = f.get_tensor("unary_offsets") if self.codec == "rice" else None
        self.frame_offsets = f.get_tensor("frame_offsets") if self.codec == "rice-zstd" else None
        self.seq_source, self.seq_token_offset = f.get_tensor("seq_source"), f.get_tensor("seq_token_offset")
        self.doc_starts = f.get_tensor("doc_starts")

    def _handle(self):
        if self._pid != os.getpid():
            self._file, self._pid = safe_open(self.path, framework="np"), os.getpid()
        return self._file

    def __len__(self) -> int:
        return len(self.seq_rows) - 1

    def rows(self, name: str, start: int, end: int) -> np.ndarray:
        return self._handle().get_slice(name)[start:end]

    def shape(self, name: str) -> list[int]:
        return self._handle().get_slice(name).get_shape()

    def tensor(self, name: str) -> np.ndarray:
        return self._handle().get_tensor(name)

    def _rice_parts(self, j: int, a: int, e: int) -> tuple[np.ndarray, ...]:
        """(lp_scale [n], lp_codes [n, K], id_rem [n, bytes], unary stream) of sequence j, rows [a, e)."""
        width = (self.k * int(self.meta["rice_b"]) + 7) // 8
        if self.codec == "rice":
            ua, ue = int(self.unary_offsets[j]), int(self.unary_offsets[j + 1])
            return (self.rows("lp_scale", a, e), self.rows("lp_codes", a, e), self.rows("id_rem", a, e),
                    self.rows("id_unary", ua, ue))
        import zstandard

        fa, fe = int(self.frame_offsets[j]), int(self.frame_offsets[j + 1])
        try:
            raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(self.rows("zstd_frames", fa, fe).tobytes()),
                                dtype=np.uint8)
        except zstandard.ZstdError as err:
            raise ValueError(f"{self.path}: zstd frame of sequence {j} does not decode ({err}); the shard is corrupt")
        n = e - a
        sizes = [2 * n, n * self.k, n * width]
        if raw.size < sum(sizes):
            raise ValueError(f"{self.path}: zstd frame of sequence {j} is {raw.size} bytes, expected at least "
                             f"{sum(sizes)}; the shard is corrupt")
        scale, lp, rem, unary = np.split(raw, np.cumsum(sizes))
        return scale.view("<f2"), lp.reshape(n, self.k), rem.reshape(n, width), unary

    def sequence(self, j: int) -> TeacherSequence:
        """Decode sequence j: ids in rank order, log-probs sorted descending with the exact top-K mass."""
        a, e = int(self.seq_rows[j]), int(self.seq_rows[j + 1])
        log_mass = self.rows("log_mass", a, e)
        if self.codec == "packed":
            logprobs = codec.dequantise_logprobs(self.rows("lp_codes", a, e), log_mass, self.rows("lp_scale", a, e))
            ids = codec.unpack_bits(self.rows("ids_packed", a, e), self.k, codec.id_bits(int(self.meta["vocab"])))
        else:
            scales, lp_codes, remainders, unary = self._rice_parts(j, a, e)
            logprobs = codec.dequantise_logprobs(lp_codes, log_mass, scales)
            ids = codec.decode_rice(remainders, unary, self.k, int(self.meta["rice_b"]))
            rank = np.argsort(-logprobs, axis=1, kind="stable")  # ties keep ascending id order
            ids, logprobs = np.take_along_axis(ids, rank, 1), np.take_along_axis(logprobs, rank, 1)
        starts = self.doc_starts[(self.doc_starts >= a) & (self.doc_starts < e)] - a
        return TeacherSequence(
            input_ids=self.rows("input_ids", a, e).astype(np.int64), ids=ids, logprobs=logprobs,
            log_mass=log_mass, log_tail=self.rows("log_tail", a, e), logz=self._logz(logprobs, a, e),
            doc_starts=starts, source_index=int(self.seq_source[j]), token_offset=int(self.seq_token_offset[j]),
            log_mass_t=self.rows("log_mass_t", a, e))

    def _logz(self, logprobs: np.ndarray, a: int, e: int) -> np.ndarray:
        """c_T as the decoded rows need it: log sum_k exp(a^_k / T) - log_mass_t, so the decoded head carries
        exactly the stored tempered mass (quantised far-down entries weigh far more at T > 1 than at T = 1)."""
        log_mass_t = self.rows("log_mass_t", a, e).astype(np.float64)
        lp = logprobs.astype(np.float64)
        cols = [np.logaddexp.reduce(lp / t, axis=1) - log_mass_t[:, i] for i, t in enumerate(self.temperatures)]
        return np.stack(cols, axis=1).astype(np.float32) if cols else np.zeros((e - a, 0), np.float32)
