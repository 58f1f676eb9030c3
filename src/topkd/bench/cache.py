"""`topkd bench cache`: bytes/token, decode fidelity and build overhead of the top-K cache on a real teacher.

    topkd bench cache --teacher SmolLM2-135M-Instruct.Q4_1.gguf --data hamlet.txt --out benchmarks/results/cache-cpu

In one process, over the same sequences: (1) build overhead: the teacher's plain forward
(`model(ids).logits`) against the cache path (body + chunked fp32 top-K head + encode + write),
timed interleaved per batch, with the head's GEMM timed alone so that the extraction's own cost
(head minus GEMM, plus encode and write) is a ratio to the forward; (2) size: each codec's shard
bytes per token, by part, against the
naive layout (int32 ids + fp16 log-probs = 6K bytes) and the empirical entropy of the id gaps;
(3) fidelity: KL(exact || decoded) per token for the bucket (K+1) and renormalised teacher; (4) targets: for
each of --targets (topk, sampled --samples N, topp --top-p P --min-k M), a cache built by `topkd cache build`
over the same sequences (default codec), its bytes/token and real entries/token, build time, and the decode
speed of reading it back whole in this process (checksums off: the decode alone).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from topkd.base.progress import track, wrote
from topkd.base.stamp import stamp
from topkd.cache import CacheBuildConfig, TopKCache, build
from topkd.cache.building import HEAD_CHUNK_BYTES, head_topk, load_teacher, split_rows
from topkd.cache.format import (
    CODECS,
    TARGET_KINDS,
    EngineRows,
    ShardReader,
    codec,
    encode_shard,
    teacher_sequence,
    write_shard,
)
from topkd.data.documents import iter_documents, pack_sequences, position_ids


@dataclass
class CacheBenchConfig:
    teacher: str = ""
    data: list[str] = field(default_factory=list)
    out: str = "benchmarks/results/cache-cpu"
    seq_len: int = 512
    k: int = 100
    sequences: int = 16
    batch_size: int = 4
    temperatures: list[float] = field(default_factory=lambda: [2.0])
    dtype: str = "float32"
    targets: list[str] = field(default_factory=lambda: list(TARGET_KINDS))
    samples: int = 50
    head: int = 0
    top_p: float = 0.95
    min_k: int = 4


CACHE_BENCH_HELP = {
    "teacher": "teacher model directory or .gguf file",
    "data": "text/jsonl/npy files",
    "out": "output directory (cache.json, report.txt)",
    "seq_len": "tokens per sequence",
    "k": "top-K",
    "sequences": "sequences measured",
    "batch_size": "sequences per teacher forward",
    "temperatures": "c_T stored for these T (part of the measured bytes)",
    "dtype": "teacher dtype",
    "targets": "caches built and read back for bytes/token and decode speed (topk, sampled, topp; none: skip)",
    "samples": "sampled arm: draws per token",
    "head": "sampled arm: this many most likely ids kept exact, the draws from the rest (a hybrid)",
    "top_p": "topp arm: mass kept per token",
    "min_k": "topp arm: entries kept per token at least",
}
TARGET_ARMS = tuple(TARGET_KINDS)


def run_cache_bench(cfg: CacheBenchConfig) -> dict:
    unknown = [kind for kind in cfg.targets if kind not in (*TARGET_ARMS, "none")]
    if unknown:  # before the teacher loads
        raise ValueError(f"targets: expected some of {TARGET_ARMS} (or none), got {unknown}")
    teacher = load_teacher(cfg.teacher, cfg.dtype)
    seqs = list(
        itertools.islice(
            pack_sequences(
                iter_documents(cfg.data, teacher.tokenizer),
                cfg.seq_len,
                teacher.tokenizer.eos_token_id,
            ),
            cfg.sequences,
        )
    )
    os.makedirs(cfg.out, exist_ok=True)
    timing, rows = _time_build(teacher, seqs, cfg)
    tokens = sum(len(s.tokens) for s in seqs)
    result = {
        "bench": "cache",
        "config": asdict(cfg),
        "stamp": stamp("cpu"),
        "tokens": tokens,
        "vocab": teacher.vocab,
        "timing": timing,
        "codecs": {},
    }
    exact = [teacher_sequence(s, r) for s, r in zip(seqs, rows)]
    for name in CODECS:
        result["codecs"][name] = _size_and_fidelity(
            exact, teacher.vocab, name, cfg.out, tuple(cfg.temperatures)
        )
    result["id_gap_entropy_bits"] = _gap_entropy(exact)
    result["naive_bytes_per_token"] = 6 * cfg.k
    result["targets"] = {
        _arm_name(cfg, kind): _measure_targets(cfg, kind) for kind in cfg.targets if kind != "none"
    }
    report = _report(result)
    print(report)
    with open(os.path.join(cfg.out, "report.txt"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(cfg.out, "cache.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {
                "bench": "cache",
                "out": cfg.out,
                "bytes_per_token": {n: c["bytes_per_token"] for n, c in result["codecs"].items()},
            }
        )
    )
    wrote("bench cache", f"report.txt and cache.json in {cfg.out}")
    return result


def _time_build(teacher, seqs, cfg) -> tuple[dict, list[EngineRows]]:
    """Interleaved per batch: the plain forward, then the cache path split into its parts."""
    t = dict.fromkeys(("forward_s", "body_s", "head_s", "head_gemm_s", "encode_write_s"), 0.0)
    rows: list[EngineRows] = []
    batches = [seqs[i : i + cfg.batch_size] for i in range(0, len(seqs), cfg.batch_size)]
    # a short last one: out
    batches = [[s for s in b if len(s.tokens) == len(b[0].tokens)] for b in batches]
    temps = tuple(cfg.temperatures)
    warm = torch.from_numpy(np.stack([s.tokens for s in batches[0]]))[:, :16]
    with torch.inference_mode():
        teacher.model(warm)  # first-call costs count for neither side
        teacher.topk_rows(warm, cfg.k, temps)
    weight, bias = teacher.head_fp32
    for batch in track(batches, desc="bench cache", unit="batch"):
        ids = torch.from_numpy(np.stack([s.tokens for s in batch]))
        pos = torch.from_numpy(np.stack([position_ids(ids.shape[1], s.doc_starts) for s in batch]))
        with torch.inference_mode():
            t["forward_s"] += _timed(
                lambda: teacher.model(ids, position_ids=pos, use_cache=False).logits
            )[1]
            h, t_body = _timed(lambda: teacher.hidden_states(ids, pos).reshape(-1, weight.shape[1]))
            flat, t_head = _timed(lambda: head_topk(h, weight, bias, cfg.k, temps))
            t["head_gemm_s"] += _timed(lambda: _gemm_only(h, weight))[1]
        per_seq = split_rows(flat, len(batch), ids.shape[1])
        t["encode_write_s"] += _timed(
            lambda: _encode_write(batch, per_seq, teacher.vocab, cfg.out, temps)
        )[1]
        t["body_s"], t["head_s"] = t["body_s"] + t_body, t["head_s"] + t_head
        rows.extend(per_seq)
    os.remove(os.path.join(cfg.out, "timing.safetensors"))
    seqs[:] = [s for b in batches for s in b]
    t["cache_path_s"] = t["body_s"] + t["head_s"] + t["encode_write_s"]
    t["overhead"] = t["cache_path_s"] / t["forward_s"] - 1
    t["extract_encode_write_over_forward"] = (
        t["head_s"] - t["head_gemm_s"] + t["encode_write_s"]
    ) / t["forward_s"]
    return t, rows


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _gemm_only(h, w) -> None:
    """The lm_head GEMM alone, in the same fp32 chunks and reused buffer as head_topk."""
    rows = max(1, min(h.shape[0], HEAD_CHUNK_BYTES // (4 * w.shape[0])))
    buf = torch.empty(rows, w.shape[0])
    for a in range(0, h.shape[0], rows):
        x = h[a : a + rows].float()
        torch.mm(x, w.t(), out=buf[: len(x)])


def _encode_write(batch, per_seq, vocab, out, temperatures) -> None:
    arrays, meta = encode_shard(
        [teacher_sequence(s, r) for s, r in zip(batch, per_seq)],
        vocab=vocab,
        temperatures=temperatures,
    )
    write_shard(os.path.join(out, "timing.safetensors"), arrays, meta)


def _arm_name(cfg: CacheBenchConfig, kind: str) -> str:
    return TARGET_KINDS[kind].label(cfg)


def _measure_targets(cfg: CacheBenchConfig, kind: str) -> dict:
    """One arm: `topkd cache build` over the bench's sequences (no stored temperature), then every sequence read
    back through TopKCache in this process; the cache is removed after."""
    out = os.path.join(cfg.out, f"targets-{kind}")
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = build(
        CacheBuildConfig(
            teacher=cfg.teacher,
            data=cfg.data,
            out=out,
            seq_len=cfg.seq_len,
            max_sequences=cfg.sequences,
            batch_size=cfg.batch_size,
            dtype=cfg.dtype,
            targets=kind,
            # the arm's own settings (a build refuses another kind's)
            **{name: getattr(cfg, name) for name in TARGET_KINDS[kind].flags},
        )
    )
    built = time.perf_counter() - start
    cache = TopKCache(out, verify_reads=False)
    start = time.perf_counter()
    real = sum(int(torch.isfinite(cache[i]["teacher_logprobs"]).sum()) for i in range(len(cache)))
    decode = time.perf_counter() - start
    shutil.rmtree(out)
    tokens = manifest["totals"]["tokens"]
    return {
        "targets": kind,
        # the kind's own settings, as its build hash records them (none for top-K)
        **{k: v for k, v in (TARGET_KINDS[kind].settings(cfg) or {}).items() if k != "kind"},
        "format_version": manifest["format_version"],
        "tokens": tokens,
        "bytes_per_token": manifest["totals"]["bytes_per_token"],
        "real_entries_per_token": real / tokens,
        "build_s": built,
        "decode_tokens_per_s": tokens / decode,
    }


def _size_and_fidelity(
    exact, vocab: int, name: str, out: str, temperatures: tuple[float, ...]
) -> dict:
    arrays, meta = encode_shard(exact, vocab=vocab, codec_name=name, temperatures=temperatures)
    path = os.path.join(out, f"sample-{name}.safetensors")
    nbytes = write_shard(path, arrays, meta)
    reader = ShardReader(path)
    kl_bucket, kl_renorm = [], []
    for j, seq in enumerate(exact):
        got = reader.sequence(j)
        a, b = _by_id(seq.ids, seq.logprobs), _by_id(got.ids, got.logprobs)
        if not np.array_equal(a[0], b[0]):
            raise AssertionError(
                f"codec {name}: decoded ids differ from the teacher's in sequence {j}"
            )
        kl_bucket.append(_kl(a[1], b[1]))
        kl_renorm.append(_kl(a[1] - _lse(a[1]), b[1] - _lse(b[1])))
    os.remove(path)
    tokens = sum(len(s) for s in exact)
    parts = {n: int(v.nbytes) for n, v in arrays.items()}
    kb, kr = np.concatenate(kl_bucket), np.concatenate(kl_renorm)
    return {
        "bytes": nbytes,
        "bytes_per_token": nbytes / tokens,
        "rice_b": meta.get("rice_b"),
        "part_bytes_per_token": {n: v / tokens for n, v in parts.items()},
        "kl_bucket_mean": float(kb.mean()),
        "kl_bucket_max": float(kb.max()),
        "kl_renorm_mean": float(kr.mean()),
        "kl_renorm_max": float(kr.max()),
    }


def _by_id(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(logprobs, order, 1).astype(
        np.float64
    )


def _lse(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def _kl(exact: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """Per token sum_k p_k (log p_k - log p^_k); the tail bucket is stored exactly, so it adds nothing."""
    return (np.exp(exact) * (exact - decoded)).sum(axis=1)


def _gap_entropy(exact) -> float:
    """Empirical entropy (bits per id) of the sorted-id gaps: a floor for any gap coder of one distribution."""
    gaps = np.concatenate([codec.sorted_gaps(s.ids.astype(np.int64))[1].ravel() for s in exact])
    counts = np.bincount(gaps)
    p = counts[counts > 0] / gaps.size
    return float(-(p * np.log2(p)).sum())


def _report(r: dict) -> str:
    s, t = r["stamp"], r["timing"]
    lines = [
        f"cache bench: {r['config']['teacher']} V={r['vocab']} K={r['config']['k']} {r['tokens']} tokens",
        f"stamp: {s['machine']}, torch {s['torch']}, topkd {s['topkd']}, commit {s['commit']}, {s['date']}",
        f"build: teacher forward (model(ids).logits) {t['forward_s']:.2f}s; cache path {t['cache_path_s']:.2f}s "
        f"({100 * t['overhead']:+.1f}%) = body {t['body_s']:.2f} + fp32 head {t['head_s']:.2f} (of which GEMM "
        f"{t['head_gemm_s']:.2f}) + encode/write {t['encode_write_s']:.2f}",
        f"top-K extraction + encode + write = {100 * t['extract_encode_write_over_forward']:.1f}% of the forward",
        f"naive int32 ids + fp16 log-probs: {r['naive_bytes_per_token']} B/token; "
        f"id gap entropy {r['id_gap_entropy_bits']:.2f} bits/id",
    ]
    for name, c in r["codecs"].items():
        parts = ", ".join(
            f"{n} {v:.1f}"
            for n, v in sorted(c["part_bytes_per_token"].items(), key=lambda kv: -kv[1])
        )
        lines.append(
            f"{name:<7} {c['bytes_per_token']:7.1f} B/token (b={c['rice_b']})  KL bucket mean "
            f"{c['kl_bucket_mean']:.2e} max {c['kl_bucket_max']:.2e}, renorm mean {c['kl_renorm_mean']:.2e} "
            f"max {c['kl_renorm_max']:.2e}\n        parts B/token: {parts}"
        )
    for name, a in r.get("targets", {}).items():
        lines.append(
            f"targets {name:<14} {a['bytes_per_token']:6.1f} B/token  {a['real_entries_per_token']:5.1f} "
            f"entries/token  format v{a['format_version']}  build {a['build_s']:6.1f} s  decode "
            f"{a['decode_tokens_per_s'] / 1e3:6.1f}K tokens/s"
        )
    return "\n".join(lines)
