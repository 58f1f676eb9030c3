"""Axolotl's KD dataset format, both ways: `topkd cache export --format axolotl` and `topkd cache import`.

    topkd cache export runs/cache --format axolotl --out runs/axolotl-kd     # an HF datasets Parquet dataset
    topkd cache import runs/axolotl-kd --tokenizer TEACHER_DIR --out runs/imported-cache

Export writes one row per document (or seq_len piece of one: the context the teacher saw), in
OUT/data/train-00000-of-00001.parquet, loadable with `datasets.load_dataset(OUT)`, with Axolotl's columns:
input_ids, attention_mask, labels (-100: no CE) and per position i the teacher's distribution of token i,
as Axolotl's trainer shifts it: target_token_ids [L][K], target_logprobs [L][K] (full-vocabulary log-probs,
rank order), target_mask [L][K] (1 where KD counts the position); position 0 is padding (mask 0). What it
loses: Axolotl renormalises the top-K (no tail bucket: the bucket loss and c_T do not cross over).

Import reads such a dataset (any K, ids in any order) into a topkd cache: row t of a sequence is the
dataset's target t + 1, so each row's last token has no row and is dropped from its inputs. The exact tail
is unknown: it is taken as 1 - top-K mass (0 when the dataset's log-probs were renormalised, which makes the
bucket loss the renormalised one) and the manifest says so; no c_T is stored (tempered bucket KD refused).
A position with target_mask 0 inside a row has no trusted teacher row: such rows are refused (per-token loss
masks are not in this cache format).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from topkd.cache import manifest as mf
from topkd.cache.build import shard_facts
from topkd.cache.compat import save_teacher_tokenizer
from topkd.cache.reader import TopKCache
from topkd.cache.shard import TeacherSequence, encode_shard, write_shard
from topkd.cache.teacher import fingerprint
from topkd.checks import require_ints, require_path
from topkd.data.dataset import TopKDataset
from topkd.files import file_sha256, write_json_atomic

FORMATS = ("axolotl",)


@dataclass
class ExportConfig:
    path: str = field(default="", metadata={"positional": True})
    format: str = "axolotl"
    out: str = ""


EXPORT_HELP = {"path": "cache directory to export", "format": "axolotl (an HF datasets Parquet dataset with "
               "Axolotl's KD columns)", "out": "output directory (must not exist, or be empty)"}


@dataclass
class ImportConfig:
    path: str = field(default="", metadata={"positional": True})
    tokenizer: str = ""
    vocab_size: int = 0
    out: str = ""


IMPORT_HELP = {"path": "an Axolotl KD dataset directory (Parquet files with target_token_ids, target_logprobs, "
               "target_mask)", "tokenizer": "the teacher's tokenizer (a local HF directory): ids and its fingerprint",
               "vocab_size": "the teacher's vocabulary (lm_head rows; 0: the tokenizer's length)",
               "out": "cache directory to write (must not exist, or be empty)"}


def check_out(out: str) -> None:
    if not out:
        raise ValueError("expected --out DIR, got none")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out!r}: expected a new or empty directory, got an existing one with files; choose "
                         "another --out")


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


def _require_datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError("expected the datasets package for the Axolotl format, got none installed; pip install "
                         "'topkd[hf]' (datasets==5.2.0)") from None
    return datasets


def axolotl_row(item: dict[str, torch.Tensor]) -> dict[str, list]:
    """One TopKDataset item (unpadded) -> one Axolotl KD row: targets shifted one position right."""
    ids, lp, counted = item["teacher_ids"], item["teacher_logprobs"], item["kd_mask"]
    k, n = ids.shape[1], len(item["input_ids"])
    target_ids = torch.cat([torch.arange(k)[None], ids[:-1]])
    target_lp = torch.cat([torch.full((1, k), -float("inf")), lp[:-1].float()])
    mask = torch.cat([torch.zeros(1, dtype=torch.bool), counted[:-1]])
    labels = torch.where(torch.cat([torch.zeros(1, dtype=torch.bool), item["labels"][:-1] >= 0]),
                         item["input_ids"], -100)
    return {"input_ids": item["input_ids"].tolist(), "attention_mask": [1] * n, "labels": labels.tolist(),
            "target_token_ids": target_ids.tolist(), "target_logprobs": target_lp.tolist(),
            "target_mask": mask[:, None].expand(n, k).int().tolist()}


def export_axolotl(cache_dir: str, out: str) -> str:
    """Write the cache as an Axolotl KD dataset in out (see the module docstring); returns the Parquet path."""
    datasets = _require_datasets()
    cache = TopKCache(cache_dir)
    data = TopKDataset(cache, packing="none")  # one row per document piece: no attention across documents
    path = os.path.join(out, DATA_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rows = datasets.Dataset.from_generator(lambda: (axolotl_row(data[i]) for i in range(len(data))))
    rows.to_parquet(path + ".tmp")
    os.replace(path + ".tmp", path)
    write_json_atomic(os.path.join(out, "topkd_export.json"),
                      {"format": "axolotl", "cache": os.path.abspath(cache_dir), "fingerprint": cache.fingerprint,
                       "rows": len(data), "lost": "the tail bucket and c_T (Axolotl renormalises over the top-K)"})
    print(f"cache export: wrote {len(data)} rows ({cache.tokens} tokens, K={cache.k}) to {path}", flush=True)
    return path


def imported_sequence(row: dict, index: int) -> TeacherSequence:
    """One Axolotl KD row -> the topkd sequence it holds (tokens 0..L-2, row t = target t + 1), rank-ordered."""
    ids = np.asarray(row["target_token_ids"], dtype=np.int64)[1:]
    lp = np.asarray(row["target_logprobs"], dtype=np.float64)[1:]
    mask = np.asarray(row["target_mask"])[1:]
    if len(ids) == 0 or not mask.all() or not np.isfinite(lp).all():
        bad = int(np.flatnonzero(~(mask.all(-1) & np.isfinite(lp).all(-1)))[0]) + 1 if len(ids) else 0
        raise ValueError(f"import: row {index} position {bad}: expected a counted target with finite log-probs at "
                         "every position after the first, got a masked or empty one; topkd caches hold a teacher row "
                         "for every token (export only the trained spans, or drop such rows)")
    order = np.argsort(-lp, axis=1, kind="stable")
    ids, lp = np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)
    log_mass = np.logaddexp.reduce(lp, axis=1)
    tail = -np.expm1(np.minimum(log_mass, 0.0))  # 1 - mass: the exact tail is unknown
    with np.errstate(divide="ignore"):
        log_tail = np.where(tail > 0, np.log(np.maximum(tail, 1e-30)), -np.inf)
    n = len(ids)
    return TeacherSequence(input_ids=np.asarray(row["input_ids"][:n], dtype=np.int64), ids=ids,
                           logprobs=lp.astype(np.float32), log_mass=log_mass.astype(np.float32),
                           log_tail=log_tail.astype(np.float32), logz=np.zeros((n, 0), np.float32),
                           doc_starts=np.zeros(1, np.int64), source_index=index)


def import_axolotl(dataset_dir: str, tokenizer_dir: str, out: str, vocab_size: int = 0) -> dict:
    """Write a topkd cache in out from an Axolotl KD dataset (see the module docstring); returns the manifest."""
    from transformers import AutoTokenizer

    datasets = _require_datasets()
    files = sorted(glob.glob(os.path.join(dataset_dir, "**", "*.parquet"), recursive=True))
    if not files:
        raise ValueError(f"import: expected Parquet files under {dataset_dir}, got none; pass the directory that "
                         "`topkd cache export --format axolotl` (or Axolotl's KD preprocessing) wrote")
    rows = datasets.Dataset.from_parquet(files)
    seqs = [imported_sequence(rows[i], i) for i in range(len(rows))]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = vocab_size or len(tokenizer)
    fp = fingerprint(source=f"imported:{os.path.abspath(dataset_dir)}", weights_sha256="unknown",
                     config_sha256="unknown", tokenizer=tokenizer, dtype="unknown", vocab=vocab,
                     k=int(seqs[0].ids.shape[1]), temperatures=(), engine="import axolotl")
    build = {"data": [{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": file_sha256(p)}
                      for p in files],
             "seq_len": max(2, max(len(s) for s in seqs)), "codec": "rice-zstd", "separator": None,
             "tail": "unknown: taken as 1 - top-K mass (imported from an Axolotl KD dataset)"}
    too_big = max(max(int(s.ids.max()), int(s.input_ids.max())) for s in seqs)
    if too_big >= vocab:
        raise ValueError(f"import: expected token ids below the vocabulary size {vocab}, got {too_big}; pass "
                         "--vocab-size (the teacher's lm_head rows) or the teacher's own tokenizer")
    return _write_imported(seqs, out, fp, build, mf.build_hash(fp, build), tokenizer)


def _write_imported(seqs: list[TeacherSequence], out: str, fp: dict, build: dict, build_hash: str,
                    tokenizer) -> dict:
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    sidecars = []
    for j, first in enumerate(range(0, len(seqs), SEQS_PER_SHARD)):
        group = seqs[first:first + SEQS_PER_SHARD]
        identity = {"build_hash": build_hash, "shard": j, "sequences": f"{first},{first + len(group)}"}
        arrays, meta = encode_shard(group, vocab=fp["vocab_size"], identity=identity)
        nbytes = write_shard(mf.shard_path(out, j), arrays, meta)
        sidecars.append(mf.write_sidecar(out, j, nbytes, first, len(group), sum(len(s) for s in group), build_hash,
                                         **shard_facts(group, meta)))
    save_teacher_tokenizer(out, tokenizer)
    manifest = mf.write_manifest(out, fp, build, sidecars)
    print(f"cache import: wrote {len(seqs)} sequences, {manifest['totals']['tokens']} tokens (K={fp['k']}, tail "
          f"unknown: 1 - top-K mass) to {out}", flush=True)
    return manifest
