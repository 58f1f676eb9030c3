"""Axolotl's KD dataset format, both ways: `topkd cache export --format axolotl` and `topkd cache import`.

    topkd cache export runs/cache --format axolotl --out runs/axolotl-kd     # an HF datasets Parquet dataset
    topkd cache import runs/axolotl-kd --tokenizer TEACHER_DIR --out runs/imported-cache

The convention is that of Axolotl v0.18.0 (AXOLOTL_VERSION), read from its source: AxolotlKDTrainer.compute_loss
hands the final hidden states [B, L, H] and target_token_ids / target_logprobs / target_mask [B, L, K] unshifted
to LigerFusedLinearKLTopKLogprobLoss, which pairs hidden state j with target row j and shifts only the labels
(CE of hidden j against labels[j + 1]). Hidden state j predicts token j + 1, so target row j is the teacher's
distribution of token j + 1: topkd's own row j, as its online-teacher collator builds it too (row j from vLLM's
prompt_logprobs[j + 1]). (Its offline chat-template strategies pad the front instead, for the trainer that
shifted before; a dataset made that way is one position off under v0.18.0's trainer.)

Export writes one row per document (or seq_len piece of one: the context the teacher saw), in
OUT/data/train-00000-of-00001.parquet, loadable with `datasets.load_dataset(OUT)`, with Axolotl's columns:
input_ids, attention_mask, labels (token i where row i - 1 takes CE, else -100), target_token_ids [L][K],
target_logprobs [L][K] (full-vocabulary log-probs in rank order: right for Axolotl's default kd_normalize_topk,
unset), target_mask [L][K] (1 where KD counts row j). What it loses: Axolotl's loss has no tail bucket, so the
bucket loss and c_T do not cross over.

Import reads such a dataset (any K, ids in any order) into a topkd cache, row j = target row j, every token
kept. The exact tail is unknown: it is taken as 1 - top-K mass (0 when the dataset's log-probs were
renormalised, which makes the bucket loss the renormalised one) and the manifest says so; no c_T is stored
(tempered bucket KD refused). A position with target_mask 0 does not count (a prompt, padding): it is stored as
a masked row (format 3, as chat caches are), so a masked cache exported by topkd imports back. Every row is
validated as the loss and the reader would (integer ids in range, K distinct, finite log-probs <= 0, top-K
mass <= 1), and refused in one line naming the row, never coerced.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from dataclasses import dataclass, field

import numpy as np
import torch

from topkd.base.checks import require_ints, require_path
from topkd.base.files import file_sha256, write_json_atomic
from topkd.base.rows import check_values
from topkd.cache.building.compat import save_teacher_tokenizer
from topkd.cache.building.teacher import fingerprint
from topkd.cache.format import manifest as mf
from topkd.cache.format.shard import (
    DEFAULT_CODEC,
    TeacherSequence,
    encode_shard,
    shard_facts,
    write_shard,
)
from topkd.cache.reading.dataset import TopKDataset
from topkd.cache.reading.reader import TopKCache

FORMATS = ("axolotl",)


@dataclass
class ExportConfig:
    path: str = field(default="", metadata={"positional": True})
    format: str = "axolotl"
    out: str = ""


EXPORT_HELP = {
    "path": "cache directory to export",
    "format": "axolotl (an HF datasets Parquet dataset with Axolotl's KD columns)",
    "out": "output directory (must not exist, or be empty)",
}


@dataclass
class ImportConfig:
    path: str = field(default="", metadata={"positional": True})
    tokenizer: str = ""
    vocab_size: int = 0
    out: str = ""


IMPORT_HELP = {
    "path": "an Axolotl KD dataset directory (Parquet files with target_token_ids, target_logprobs, "
    "target_mask)",
    "tokenizer": "the teacher's tokenizer (a local HF directory): ids and its fingerprint",
    "vocab_size": "the teacher's vocabulary (lm_head rows; 0: the tokenizer's length)",
    "out": "cache directory to write (must not exist, or be empty)",
}


def check_out(out: str) -> None:
    if not out:
        raise ValueError("expected --out DIR, got none")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(
            f"--out {out!r}: expected a new or empty directory, got an existing one with files; choose "
            "another --out"
        )


def run_export(cfg: ExportConfig) -> str:
    if cfg.format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {cfg.format!r}")
    require_path("cache", cfg.path, "dir")
    check_out(cfg.out)
    return export_axolotl(cfg.path, cfg.out)


def run_import(cfg: ImportConfig) -> dict:
    require_path("dataset", cfg.path, "dir")
    require_path("--tokenizer", cfg.tokenizer, "dir")
    require_ints(cfg, ("vocab_size",), 0)
    check_out(cfg.out)
    return import_axolotl(cfg.path, cfg.tokenizer, cfg.out, cfg.vocab_size)


DATA_FILE = os.path.join("data", "train-00000-of-00001.parquet")
SEQS_PER_SHARD = 64


@contextlib.contextmanager
def _quiet(datasets):
    """The datasets library's own progress bars off (its "Generating train split" lines) while topkd reports."""
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _require_datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "expected the datasets package for the Axolotl format, got none installed; pip install "
            "'topkd[hf]' (datasets==5.2.0)"
        ) from None
    return datasets


# the release whose trainer, loss and collators the convention above is read from
AXOLOTL_VERSION = "0.18.0"


def axolotl_row(item: dict[str, torch.Tensor]) -> dict[str, list]:
    """One TopKDataset item (unpadded) -> one Axolotl KD row: target row j is topkd's row j (the distribution of
    token j + 1, for hidden state j); labels[i] is token i where row i - 1 takes CE (Axolotl shifts labels)."""
    ids, lp, counted = item["teacher_ids"], item["teacher_logprobs"], item["kd_mask"]
    k, n = ids.shape[1], len(item["input_ids"])
    labels = torch.where(
        torch.cat([torch.zeros(1, dtype=torch.bool), item["labels"][:-1] >= 0]),
        item["input_ids"],
        -100,
    )
    return {
        "input_ids": item["input_ids"].tolist(),
        "attention_mask": [1] * n,
        "labels": labels.tolist(),
        "target_token_ids": ids.tolist(),
        "target_logprobs": lp.float().tolist(),
        "target_mask": counted[:, None].expand(n, k).int().tolist(),
    }


def export_axolotl(cache_dir: str, out: str) -> str:
    """Write the cache as an Axolotl KD dataset in out (see the module docstring); returns the Parquet path. The
    cache is verified first; a failure part way removes what this export wrote, so a rerun starts clean."""
    cache = _exportable(cache_dir)  # the rows' kind before the extra: a refusal costs no install
    datasets = _require_datasets()
    _verified(cache)
    # one row per document piece: no attention across documents
    data = TopKDataset(cache, packing="none")
    path = os.path.join(out, DATA_FILE)
    existed = os.path.isdir(out)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _quiet(datasets):
            rows = datasets.Dataset.from_generator(
                lambda: (axolotl_row(data[i]) for i in range(len(data)))
            )
            rows.to_parquet(path + ".tmp")
        os.replace(path + ".tmp", path)
        write_json_atomic(
            os.path.join(out, "topkd_export.json"),
            {
                "format": "axolotl",
                "cache": os.path.abspath(cache_dir),
                "fingerprint": cache.fingerprint,
                "rows": len(data),
                "lost": "the tail bucket and c_T (Axolotl renormalises over the top-K)",
            },
        )
    except BaseException as e:
        # check_out: it held nothing of anyone's
        for name in os.listdir(out) if os.path.isdir(out) else []:
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        # datasets wraps the generator's
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else None
        if cause is not None:
            raise cause from None
        raise
    print(
        f"cache export: wrote {len(data)} rows ({cache.tokens} tokens, K={cache.k}) to {path}",
        flush=True,
    )
    return path


def _exportable(cache_dir: str) -> TopKCache:
    """The cache, if the Axolotl format can hold its rows (top-K targets)."""
    cache = TopKCache(cache_dir)
    refusal = cache.target_kind.export_refusal
    if refusal:
        raise ValueError(
            f"cache {cache_dir}: expected top-K targets for the Axolotl format, got {cache.targets} "
            f"targets ({refusal}); export a cache built with "
            "--targets topk, or train on this one with topkd itself (topkd train, KDTrainer, TopKDataset)"
        )
    return cache


def _verified(cache: TopKCache) -> None:
    """Refuse a cache any of whose shards fails its checksum."""
    cache_dir = cache.path
    problems = cache.verify()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise mf.CacheError(
            f"cache {cache_dir}: {problems[0]}{more}; rerun its build command to repair it, then export"
        )


IMPORT_COLUMNS = ("input_ids", "target_token_ids", "target_logprobs", "target_mask")


def imported_sequence(row: dict, index: int, vocab: int) -> TeacherSequence:
    """One Axolotl KD row -> the topkd sequence it holds (row j = target row j, every token), rank-ordered.
    Validated as the loss and the reader would: a bad row is refused here, never at training step N."""
    where = f"import: row {index}"
    inputs, ids, lp, counted = _imported_columns(row, where, vocab)
    try:  # exactly the loss's own value checks, on the rows that count
        check_values(
            torch.from_numpy(ids[counted]),
            torch.from_numpy(lp[counted]),
            None,
            None,
            vocab,
            "renorm",
            1.0,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    ids, lp = _placeholder_rows(ids, lp, ~counted, vocab)
    order = np.argsort(-lp, axis=1, kind="stable")
    ids, lp = np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)
    log_mass = np.logaddexp.reduce(lp, axis=1)
    tail = -np.expm1(np.minimum(log_mass, 0.0))  # 1 - mass: the exact tail is unknown
    with np.errstate(divide="ignore"):
        log_tail = np.where(tail > 0, np.log(np.maximum(tail, 1e-30)), -np.inf)
    return TeacherSequence(
        input_ids=inputs.astype(np.int64),
        ids=ids,
        logprobs=lp.astype(np.float32),
        log_mass=log_mass.astype(np.float32),
        log_tail=log_tail.astype(np.float32),
        logz=np.zeros((len(ids), 0), np.float32),
        doc_starts=np.zeros(1, np.int64),
        source_index=index,
        row_mask=None if counted.all() else counted,
    )


def _imported_columns(row: dict, where: str, vocab: int):
    """A row's columns as arrays, their shapes and integer ids checked: (input ids, target ids, log-probs, which
    positions count)."""
    inputs = _numbers(row, "input_ids", where, 1)
    ids, lp, mask = (_numbers(row, name, where, 2) for name in IMPORT_COLUMNS[1:])
    if not lp.shape == mask.shape == ids.shape or len(inputs) != len(ids) or len(ids) < 1:
        raise ValueError(
            f"{where}: expected input_ids [L] and target_token_ids, target_logprobs, target_mask [L][K] "
            f"of one length L >= 1, got {len(inputs)}, {ids.shape}, {lp.shape}, {mask.shape}; every "
            "position needs its K targets (Axolotl pads with mask 0)"
        )
    for name, values in (("input_ids", inputs), ("target_token_ids", ids)):
        if not (np.isfinite(values).all() and (values == np.round(values)).all()):
            raise ValueError(
                f"{where} {name}: expected integer token ids, got fractional or null values; the "
                "dataset was not written as token ids (cast them, or re-export it)"
            )
    if inputs.min() < 0 or inputs.max() >= vocab:
        raise ValueError(
            f"{where} input_ids: expected ids in [0, {vocab}), got range [{int(inputs.min())}, "
            f"{int(inputs.max())}]; pass the teacher's tokenizer, or --vocab-size its lm_head rows"
        )
    mask = mask != 0
    counted = mask.all(1)
    if (mask.any(1) & ~counted).any():
        raise ValueError(
            f"{where} position {int(np.flatnonzero(mask.any(1) & ~counted)[0])}: expected a "
            "target_mask of all 1 or all 0 across the K entries, got a mix; topkd rows hold K entries"
        )
    return inputs, ids.astype(np.int64), lp, counted


def check_alignment(seqs: list[TeacherSequence]) -> None:
    """One position off distils silently wrong: a teacher's top-1 at row j is often the next token (j + 1), and
    seldom the current one. A dataset whose top-1 matches the current token far more often was written one
    position shifted (the front-padded convention); it is refused, not imported."""
    hits = {"next": 0, "current": 0, "rows": 0}
    for s in seqs:
        top1 = s.ids[:, 0]
        counted = np.ones(len(s), bool) if s.row_mask is None else s.row_mask
        hits["next"] += int(((top1[:-1] == s.input_ids[1:]) & counted[:-1]).sum())
        hits["current"] += int(((top1 == s.input_ids) & counted).sum())
        hits["rows"] += int(counted.sum())
    rows = max(hits["rows"], 1)
    if hits["current"] > 0.2 * rows and hits["current"] > 2 * hits["next"]:
        raise ValueError(
            f"import: expected target row j to be the teacher's distribution of token j + 1 (Axolotl "
            f"{AXOLOTL_VERSION}'s trainer pairs it with hidden state j), got rows whose top-1 is token j "
            f"itself in {hits['current'] / rows:.0%} of them (token j + 1: {hits['next'] / rows:.0%}): "
            "written one position shifted (front-padded); shift it back (row j <- row j + 1)"
        )


def _numbers(row: dict, name: str, where: str, dims: int) -> np.ndarray:
    value = row.get(name)
    text = _first_text(value) if _may_hold_text(value) else None
    if text is not None:  # float("12") would read it as a number, and hide a dataset written wrong
        raise ValueError(
            f"{where} {name}: expected numbers, got text ({text!r}); the dataset was written with its "
            "numbers as strings: cast the column to integers (ids, mask) or floats (log-probs)"
        )
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        array = None
    if value is None or array is None or array.ndim != dims:
        shape = "[L]" if dims == 1 else "[L][K] (K entries at every position)"
        raise ValueError(
            f"{where} {name}: expected a {shape} list of numbers, got "
            f"{'null' if value is None else 'ragged or non-numeric lists'}; repair or drop that row"
        )
    return array


def _may_hold_text(value) -> bool:
    """Not a plain array of numbers (numpy's own fast read of the lists says so)."""
    try:
        return np.asarray(value).dtype.kind not in "biuf"
    except ValueError:  # ragged
        return True


def _first_text(value) -> str | None:
    """The first string among a row's nested lists, or None."""
    if isinstance(value, (str, bytes)):
        return value if isinstance(value, str) else value.decode(errors="replace")
    if isinstance(value, (list, tuple, np.ndarray)) and not (
        isinstance(value, np.ndarray) and value.dtype.kind in "biuf"
    ):
        for item in value:
            text = _first_text(item)
            if text is not None:
                return text
    return None


def _placeholder_rows(ids: np.ndarray, lp: np.ndarray, rows: np.ndarray, vocab: int):
    """Rows that do not count (target_mask 0: prompts, padding) keep the teacher's entries when those are a valid
    row, else get a uniform stand-in (ids 0..K-1): never read by the loss, but every stored row must decode."""
    k = ids.shape[1]
    s = np.sort(ids, axis=1)
    valid = (
        (ids >= 0).all(1)
        & (ids < vocab).all(1)
        & (s[:, 1:] != s[:, :-1]).all(1)
        & np.isfinite(lp).all(1)
        & (lp <= 0).all(1)
        & (np.exp(np.minimum(lp, 0)).sum(1) <= 1 + 1e-2)
    )
    stand_in = rows & ~valid
    ids, lp = ids.copy(), lp.copy()
    ids[stand_in], lp[stand_in] = np.arange(k), -np.log(vocab)
    return ids, lp


def _read_import_rows(dataset_dir: str, files: list[str]):
    """The dataset's rows, or one line saying what is wrong with the files as a whole."""
    datasets = _require_datasets()
    import pyarrow.parquet  # datasets' own reader

    try:
        if sum(pyarrow.parquet.ParquetFile(f).metadata.num_rows for f in files) == 0:
            raise ValueError(
                f"import: expected rows, got 0 rows in {len(files)} Parquet file(s) under {dataset_dir}; "
                "export a dataset with rows"
            )
        with _quiet(datasets):
            rows = datasets.Dataset.from_parquet(files)
    # datasets wraps every reader failure (DatasetGenerationError, ArrowInvalid, ...)
    except Exception as e:
        if str(e).startswith("import: expected rows"):
            raise
        cause = e.__cause__ or e
        raise ValueError(
            f"import: expected readable Parquet files under {dataset_dir}, got {type(cause).__name__}: "
            f"{str(cause).splitlines()[0][:200] if str(cause) else ''}; re-export the dataset"
        ) from None
    missing = [c for c in IMPORT_COLUMNS if c not in rows.column_names]
    if missing or len(rows) == 0:
        raise ValueError(
            f"import: expected rows with the columns {list(IMPORT_COLUMNS)}, got {len(rows)} rows with "
            f"{rows.column_names}; pass an Axolotl KD dataset (what `topkd cache export --format "
            "axolotl` or Axolotl's KD preprocessing writes)"
        )
    return rows


def import_axolotl(dataset_dir: str, tokenizer_dir: str, out: str, vocab_size: int = 0) -> dict:
    """Write a topkd cache in out from an Axolotl KD dataset (see the module docstring); returns the manifest."""
    from transformers import AutoTokenizer

    files = sorted(glob.glob(os.path.join(dataset_dir, "**", "*.parquet"), recursive=True))
    if not files:
        raise ValueError(
            f"import: expected Parquet files under {dataset_dir}, got none; pass the directory that "
            "`topkd cache export --format axolotl` (or Axolotl's KD preprocessing) wrote"
        )
    rows = _read_import_rows(dataset_dir, files)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = vocab_size or len(tokenizer)
    seqs = [imported_sequence(rows[i], i, vocab) for i in range(len(rows))]
    if len({s.ids.shape[1] for s in seqs}) > 1:
        raise ValueError(
            f"import: expected one K in every row, got {sorted({s.ids.shape[1] for s in seqs})}; "
            "re-export the dataset with one top-K"
        )
    check_alignment(seqs)
    if not sum(len(s) if s.row_mask is None else int(s.row_mask.sum()) for s in seqs):
        raise ValueError(
            f"import: expected some counted targets (target_mask 1), got none in {len(rows)} rows; "
            "nothing would train"
        )
    fp = fingerprint(
        source=f"imported:{os.path.abspath(dataset_dir)}",
        weights_sha256="unknown",
        config_sha256="unknown",
        tokenizer=tokenizer,
        dtype="unknown",
        vocab=vocab,
        k=int(seqs[0].ids.shape[1]),
        temperatures=(),
        engine="import axolotl",
    )
    build = {
        "data": [
            {"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": file_sha256(p)}
            for p in files
        ],
        "seq_len": max(2, max(len(s) for s in seqs)),
        "codec": DEFAULT_CODEC,
        "separator": None,
        "tail": "unknown: taken as 1 - top-K mass (imported from an Axolotl KD dataset)",
    }
    return _write_imported(seqs, out, fp, build, mf.build_hash(fp, build), tokenizer)


def _write_imported(
    seqs: list[TeacherSequence], out: str, fp: dict, build: dict, build_hash: str, tokenizer
) -> dict:
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    # rows Axolotl padded (-inf): format 5
    variable_k = any(bool(np.isneginf(s.logprobs).any()) for s in seqs)
    sidecars = []
    for j, first in enumerate(range(0, len(seqs), SEQS_PER_SHARD)):
        group = seqs[first : first + SEQS_PER_SHARD]
        identity = {
            "build_hash": build_hash,
            "shard": j,
            "sequences": f"{first},{first + len(group)}",
        }
        arrays, meta = encode_shard(
            group, vocab=fp["vocab_size"], identity=identity, variable_k=variable_k
        )
        nbytes = write_shard(mf.shard_path(out, j), arrays, meta)
        sidecars.append(
            mf.write_sidecar(
                out,
                j,
                nbytes,
                first,
                len(group),
                sum(len(s) for s in group),
                build_hash,
                **shard_facts(group, meta),
            )
        )
    manifest = mf.write_manifest(out, fp, build, sidecars, save_teacher_tokenizer(out, tokenizer))
    print(
        f"cache import: wrote {len(seqs)} sequences, {manifest['totals']['tokens']} tokens (K={fp['k']}, tail "
        f"unknown: 1 - top-K mass) to {out}",
        flush=True,
    )
    return manifest
