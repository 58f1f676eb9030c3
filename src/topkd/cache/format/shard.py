"""One cache shard: consecutive sequences encoded into a safetensors file, and decoded back.

    arrays, meta = encode_shard(sequences, vocab=V, codec_name="rice-zstd", identity={"build_hash": h, ...})
    write_shard(path, arrays, meta)            # temp file, fsync, rename: never half-written
    seq = ShardReader(path).sequence(j)        # j-th sequence of the shard, as numpy arrays

docs/cache-format.md describes every tensor; tests/cache/test_golden.py pins the bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from topkd.base.files import write_atomic
from topkd.cache.format import codec, shard_codecs
from topkd.cache.format.text import TEXT_TENSORS, TEXT_VERSION, read_text, text_arrays

# Format versions. 2: per-token compander scale, exact tempered head mass, shard identity in meta_json. 3: a per-row
# loss mask (row_mask, chat data); a shard without row_mask is written as version 2, byte for byte as before.
# 4: rows of variable K (sampled targets): version 3 plus padding entries (log-prob code 255, decoded -inf).
# 5: rows of variable K stored ragged (rice-zstd: cache/format/ragged.py), sampled targets as draw counts.
# 6: any of those layouts (meta_json's layout_version) plus each sequence's text (cache/format/text.py).
# Earlier versions still open.
FORMAT_VERSION = 3
UNMASKED_VERSION = 2
VARIABLE_K_VERSION = 4
RAGGED_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5, TEXT_VERSION)
BASE_TENSORS = frozenset({"input_ids", "seq_rows", "seq_source", "seq_token_offset", "doc_starts"})
# implied by draw counts (version 5)
SCALAR_TENSORS = frozenset({"log_mass", "log_tail", "logz", "log_mass_t"})
CODECS = tuple(shard_codecs.CODECS)  # names
DEFAULT_CODEC = shard_codecs.DEFAULT_CODEC


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
    # [L, n_temperatures] float32, log sum_k exp(a_k / T - c_T), exact
    log_mass_t: np.ndarray | None = None
    # [L] bool: row t counts for KD and CE (chat targets); None: every row
    row_mask: np.ndarray | None = None
    text: str | None = None  # version 6: the text the input ids spell (None: not recorded)
    char_len: np.ndarray | None = (
        None  # [L] characters of text each input token owns (topkd.data.spans)
    )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def encode_shard(
    seqs: list[TeacherSequence],
    *,
    vocab: int,
    codec_name: str = DEFAULT_CODEC,
    identity: dict | None = None,
    temperatures: tuple[float, ...] = (),
    variable_k: bool = False,
    samples: int | None = None,
) -> tuple[dict, dict]:
    """Sequences -> (tensor name -> numpy array, string metadata) for one shard.

    identity (build_hash, shard, sequences) goes into the checksummed bytes, so a shard moved in from
    another cache or position is refused by the reader; temperatures name the columns of logz.
    variable_k: entries with log-prob -inf are padding: version 5 (ragged) with rice-zstd, else version 4;
    samples (sampled targets): the log-probs are log(count / samples); version 5 stores the counts."""
    id_codec = shard_codecs.lookup(codec_name)
    if not seqs:
        raise ValueError("a shard needs at least one sequence, got none")
    arrays = _sequence_arrays(seqs, temperatures)
    ids, logprobs = _joined(seqs, "ids").astype(np.int64), _joined(seqs, "logprobs")
    ragged = variable_k and id_codec.stores_ragged
    masked = any(s.row_mask is not None for s in seqs) or (variable_k and not ragged)
    if masked:  # version 3: which rows count (1) and which are context only (0)
        arrays["row_mask"] = np.concatenate(
            [np.ones(len(s), bool) if s.row_mask is None else s.row_mask for s in seqs]
        ).astype(np.uint8)
    meta = _shard_meta(
        codec_name, seqs[0].ids.shape[1], vocab, temperatures, variable_k, ragged, masked
    )
    meta.update({key: str(value) for key, value in (identity or {}).items()})
    padding = np.isneginf(logprobs) if variable_k else None
    coded, coded_meta = id_codec.encode(
        ids,
        logprobs,
        codec.row_scales(logprobs),
        arrays["seq_rows"],
        vocab,
        padding,
        samples if ragged else None,
        ragged,
    )
    if ragged:
        arrays = _ragged_arrays(arrays, vocab, samples, temperatures)
    text = text_arrays(seqs)
    if text:  # version 6: the layout above, read as its own version, plus the text
        meta.update(format_version=str(TEXT_VERSION), layout_version=meta["format_version"])
    return {**arrays, **coded, **text}, {**meta, **coded_meta}


def _joined(seqs: list[TeacherSequence], name: str) -> np.ndarray:
    return np.concatenate([getattr(s, name) for s in seqs])


def _sequence_arrays(
    seqs: list[TeacherSequence], temperatures: tuple[float, ...]
) -> dict[str, np.ndarray]:
    """The tensors every shard version stores whatever its codec: tokens, per-row scalars, sequence bounds."""
    rows = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    logz = _joined(seqs, "logz").astype(np.float32).reshape(int(rows[-1]), -1)
    if logz.shape[1] != len(temperatures):
        raise ValueError(
            f"logz: expected one column per temperature {list(temperatures)}, got {logz.shape[1]}"
        )
    return {
        "input_ids": _joined(seqs, "input_ids").astype(np.int32),
        "log_mass": _joined(seqs, "log_mass").astype(np.float32),
        "log_tail": _joined(seqs, "log_tail").astype(np.float32),
        "logz": logz,
        "log_mass_t": _tempered_masses(seqs, logz.shape[1]),
        "seq_rows": rows,
        "seq_source": np.array([s.source_index for s in seqs], dtype=np.int64),
        "seq_token_offset": np.array([s.token_offset for s in seqs], dtype=np.int64),
        "doc_starts": np.concatenate(
            [s.doc_starts.astype(np.int64) + r for s, r in zip(seqs, rows)]
        ),
    }


def _shard_meta(
    codec_name: str,
    k: int,
    vocab: int,
    temperatures: tuple[float, ...],
    variable_k: bool,
    ragged: bool,
    masked: bool,
) -> dict[str, str]:
    """meta_json: the format version these rows need (the oldest that holds them), codec and shapes."""
    if ragged:
        version = RAGGED_VERSION
    elif variable_k:
        version = VARIABLE_K_VERSION
    else:
        version = FORMAT_VERSION if masked else UNMASKED_VERSION
    meta = {
        "format_version": str(version),
        "codec": codec_name,
        "k": str(k),
        "vocab": str(vocab),
        "temperatures": json.dumps([float(t) for t in temperatures]),
    }
    if ragged:
        meta["masked"] = "1" if masked else "0"
    return meta


def _ragged_arrays(
    arrays: dict, vocab: int, samples: int | None, temperatures: tuple[float, ...]
) -> dict:
    """Version 5: small vocabularies' input ids in 2 bytes; draw counts imply the per-row scalars."""
    arrays = {
        **arrays,
        "input_ids": arrays["input_ids"].astype(np.uint16 if vocab <= 2**16 else np.int32),
    }
    if samples and temperatures:
        raise ValueError(
            "samples: sampled targets store no temperatures, got " + str(list(temperatures))
        )
    if samples:
        arrays = {name: v for name, v in arrays.items() if name not in SCALAR_TENSORS}
    return arrays


def expected_tensors(meta: dict, codec_tensors: frozenset) -> frozenset:
    """The tensors a shard of this meta must hold (besides meta_json): the reader refuses any other set.
    row_mask: versions 3 and 4 always, version 5 when its meta says `masked`; version 6 adds the text."""
    version = layout_version(meta)
    scalars = frozenset() if meta.get("values") == "counts" else SCALAR_TENSORS
    masked = version in (FORMAT_VERSION, VARIABLE_K_VERSION) or meta.get("masked") == "1"
    mask = frozenset({"row_mask"}) if masked else frozenset()
    text = TEXT_TENSORS if int(meta.get("format_version", 2)) == TEXT_VERSION else frozenset()
    return BASE_TENSORS | scalars | codec_tensors | mask | text


def layout_version(meta: dict) -> int:
    """The version whose layout a shard's rows use: its format_version, or a version-6 shard's layout_version."""
    version = int(meta.get("format_version", UNMASKED_VERSION))
    if version != TEXT_VERSION:
        return version
    layout = int(meta["layout_version"])
    if layout not in READABLE_VERSIONS[:-1]:
        raise ValueError(f"layout_version: expected one of {READABLE_VERSIONS[:-1]}, got {layout}")
    return layout


def _tempered_masses(seqs: list[TeacherSequence], n_temperatures: int) -> np.ndarray:
    """log_mass_t of every row: the exact tempered top-K mass the reader renormalises the decoded head to."""
    parts = []
    for s in seqs:
        if s.log_mass_t is None and n_temperatures:
            raise ValueError(
                "log_mass_t: expected the exact tempered top-K mass per stored temperature, got None"
            )
        parts.append(np.zeros((len(s), 0), np.float32) if s.log_mass_t is None else s.log_mass_t)
    return (
        np.concatenate(parts).astype(np.float32).reshape(sum(len(s) for s in seqs), n_temperatures)
    )


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


def read_row_counts(path: str) -> tuple[int, int]:
    """(rows, counted rows) from a shard's own tensors (seq_rows, row_mask): what its sidecar must record."""
    with safe_open(path, framework="np") as f:
        rows = int(f.get_tensor("seq_rows")[-1])
        counted = (
            int(f.get_tensor("row_mask").astype(bool).sum()) if "row_mask" in f.keys() else rows
        )
    return rows, counted


# a per-sequence offsets tensor -> the stream it cuts
OFFSET_STREAMS = {"frame_offsets": "zstd_frames", "unary_offsets": "id_unary"}


class ShardError(ValueError):
    """A shard whose header or rows do not parse as its format says: corrupt, or rewritten by hand."""


class ShardReader:
    """Lazy, memory-mapped access to one shard; re-opens itself after a fork (DataLoader workers)."""

    def __init__(self, path: str):
        self.path = path
        self._pid, self._file = None, None
        f = self._handle()
        try:
            self.meta = json.loads(f.get_tensor("meta_json").tobytes())
            self._parse_meta(self.meta)
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            # a damaged or hand-edited header: one line, never a bare KeyError from deep inside a decode
            what = f"no {err} key" if isinstance(err, KeyError) else str(err)
            raise ShardError(f"{path}: its metadata does not parse ({what})") from None
        self.names = set(f.keys()) - {"meta_json"}
        self.seq_rows = f.get_tensor("seq_rows")
        self._offsets: dict[str, np.ndarray] = {}
        self.seq_source, self.seq_token_offset = (
            f.get_tensor("seq_source"),
            f.get_tensor("seq_token_offset"),
        )
        self.doc_starts = f.get_tensor("doc_starts")

    def _parse_meta(self, meta: dict) -> None:
        """Every header field a decode reads, parsed once here: a missing or malformed one fails now."""
        self.k, self.codec, self.vocab = int(meta["k"]), meta["codec"], int(meta["vocab"])
        version = layout_version(meta)
        self.has_text = int(meta.get("format_version", 2)) == TEXT_VERSION
        self.variable_k = version >= VARIABLE_K_VERSION  # padding entries
        self.ragged = version >= RAGGED_VERSION  # cache/format/ragged.py
        self.samples = int(meta["samples"]) if meta.get("values") == "counts" else None
        self.id_codec = shard_codecs.lookup(self.codec, "codec")
        self.rice_table = [int(b) for b in meta["rice_b_table"].split(",")] if self.ragged else []
        if self.ragged and (
            len(self.rice_table) != codec.context_count(self.k)
            or not all(0 <= b <= codec.MAX_RICE_PARAMETER for b in self.rice_table)
        ):
            raise ValueError(
                f"rice_b_table: expected {codec.context_count(self.k)} parameters in "
                f"0..{codec.MAX_RICE_PARAMETER} for K={self.k}, got {meta['rice_b_table']!r}"
            )
        if not self.ragged:
            for key in self.id_codec.meta_keys:
                int(meta[key])
        if self.samples is not None and not 1 <= self.samples <= 255:
            raise ValueError(f"samples: expected 1..255, got {self.samples}")
        self.temperatures = [float(t) for t in json.loads(meta.get("temperatures", "[]"))]

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

    def offsets(self, name: str) -> np.ndarray:
        """A small per-sequence offsets tensor (unary_offsets, frame_offsets), read and checked once: one entry
        per sequence and one more, from 0, never decreasing, ending at the size of the stream it cuts."""
        if name not in self._offsets:
            offsets = self.tensor(name).astype(np.int64)
            end = self.shape(OFFSET_STREAMS[name])[0]
            if (
                offsets.shape != (len(self) + 1,)
                or offsets[0] != 0
                or (np.diff(offsets) < 0).any()
                or offsets[-1] != end
            ):
                raise ShardError(
                    f"{self.path}: {name} must rise from 0 to {end} (the size of {OFFSET_STREAMS[name]}) "
                    f"in {len(self) + 1} steps; got {offsets[:6].tolist()}...; the shard is corrupt"
                )
            self._offsets[name] = offsets
        return self._offsets[name]

    def sequence(self, j: int) -> TeacherSequence:
        """Decode sequence j: ids in rank order, log-probs sorted descending with the exact top-K mass."""
        a, e = int(self.seq_rows[j]), int(self.seq_rows[j + 1])
        scalars = self._scalars(a, e)
        ids, logprobs = self.id_codec.decode(self, j, a, e, scalars["log_mass"])
        self._check_rows(j, ids, logprobs)
        starts = self.doc_starts[(self.doc_starts >= a) & (self.doc_starts < e)] - a
        text, char_len = read_text(self, j, a, e) if self.has_text else (None, None)
        return TeacherSequence(
            input_ids=self.rows("input_ids", a, e).astype(np.int64),
            ids=ids,
            logprobs=logprobs,
            logz=self._logz(logprobs, scalars["log_mass_t"]),
            doc_starts=starts,
            source_index=int(self.seq_source[j]),
            token_offset=int(self.seq_token_offset[j]),
            log_mass=scalars["log_mass"],
            log_tail=scalars["log_tail"],
            log_mass_t=scalars["log_mass_t"],
            row_mask=self.rows("row_mask", a, e).astype(bool) if "row_mask" in self.names else None,
            text=text,
            char_len=char_len,
        )

    def error(self, what: str) -> ShardError:
        """A refusal of this shard as corrupt, naming it."""
        return ShardError(f"{self.path}: {what}; the shard is corrupt")

    def _check_rows(self, j: int, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """What every decoded row must be, checked as it leaves the decoder (a shard rewritten with matching
        checksums reaches here): at least one real entry, no NaN, ids in [0, V)."""
        bad = (
            np.isnan(logprobs).any(axis=1)
            | ~np.isfinite(logprobs).any(axis=1)
            | (ids < 0).any(axis=1)
            | (ids >= self.vocab).any(axis=1)
        )
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ShardError(
                f"{self.path}: sequence {j}, row {r} decodes to ids {ids[r][:4].tolist()}... / log-probs "
                f"{logprobs[r][:4].tolist()}...: expected at least one finite log-prob, no NaN and ids "
                f"below V={self.vocab}; the shard is corrupt"
            )

    def _scalars(self, a: int, e: int) -> dict[str, np.ndarray]:
        """log_mass, log_tail, log_mass_t of rows [a, e); draw counts (version 5) imply them: mass 1, no tail."""
        if self.samples:
            return {
                "log_mass": np.zeros(e - a, np.float32),
                "log_tail": np.full(e - a, -np.inf, np.float32),
                "log_mass_t": np.zeros((e - a, 0), np.float32),
            }
        return {name: self.rows(name, a, e) for name in ("log_mass", "log_tail", "log_mass_t")}

    def _logz(self, logprobs: np.ndarray, log_mass_t: np.ndarray) -> np.ndarray:
        """c_T as the decoded rows need it: log sum_k exp(a^_k / T) - log_mass_t, so the decoded head carries
        exactly the stored tempered mass (quantised far-down entries weigh far more at T > 1 than at T = 1)."""
        if not self.temperatures:
            return np.zeros((len(logprobs), 0), np.float32)
        lp, log_mass_t = logprobs.astype(np.float64), log_mass_t.astype(np.float64)
        cols = [
            np.logaddexp.reduce(lp / t, axis=1) - log_mass_t[:, i]
            for i, t in enumerate(self.temperatures)
        ]
        return np.stack(cols, axis=1).astype(np.float32)


def shard_facts(rows: list[TeacherSequence], meta: dict) -> dict:
    """What a sidecar records beside the checksum: the largest token id, the format version, counted rows."""
    return {
        "max_id": max(sequence_max_id(r) for r in rows),
        "format_version": int(meta["format_version"]),
        "counted": sum(len(r) if r.row_mask is None else int(r.row_mask.sum()) for r in rows),
    }


def sequence_max_id(seq: TeacherSequence) -> int:
    """The largest token id a sequence holds: its input ids and the ids of its real (not padding) entries."""
    real = _real_ids(seq)
    return max(int(real.max()) if real.size else 0, int(seq.input_ids.max()))


def _real_ids(seq: TeacherSequence) -> np.ndarray:
    """The ids of a sequence's entries that are not padding (padding ids are never read)."""
    return seq.ids[~np.isneginf(seq.logprobs)]
