"""The `topkd` command line: one command, subcommands per job.

    topkd cache build --teacher MODEL --data corpus.txt --out runs/cache --seq-len 2048 --k 100
    topkd cache verify runs/cache          # every checksum
    topkd cache inspect runs/cache         # fingerprint, totals, bytes/token, top-K mass histogram
    topkd train --cache runs/cache --init-from-teacher --layers 6 --out runs/student --steps 500
    topkd eval --model runs/student/final --text held_out.txt --cache runs/heldout-cache --choices mmlu.jsonl
    topkd demo [--quick]                   # the whole pipeline on SmolLM2 + Shakespeare, one output directory
    topkd bench loss [--lengths 1024,4096] [--vocab 32768] [--hidden 512] [--out DIR]
    topkd bench cache --teacher MODEL --data corpus.txt   # bytes/token, decode KL, build overhead
    topkd bench train [--lengths 4096,16384,32768]         # training step memory/time per impl, cache loading
    topkd bench model [--device h200] [--calibrate]        # cost model: predicted time/memory; vs bench loss here

Every subcommand is also a Python function (topkd.cache.build, topkd.cache.inspect, ...).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from topkd.bench.cache import CACHE_BENCH_HELP, CacheBenchConfig, run_cache_bench
from topkd.bench.loss import LossBenchConfig, run_loss_bench
from topkd.bench.model import MODEL_BENCH_HELP, ModelBenchConfig, run_model_bench
from topkd.bench.train import TRAIN_BENCH_HELP, TrainBenchConfig, run_train_bench
from topkd.cache.build import BUILD_HELP, CacheBuildConfig, build
from topkd.cache.inspect import inspect_cache, verify_cache
from topkd.demo import DEMO_HELP, DemoConfig
from topkd.eval.run import EVAL_HELP, EvalConfig
from topkd.signals import Interrupted, signals_raise
from topkd.train.config import TRAIN_HELP, TrainConfig

BENCH_HELP = {
    "lengths": "comma-separated token counts (sequence lengths) to sweep",
    "impls": "comma-separated impls: fused, chunked, dense, liger_jsd, torch_lce",
    "vocab": "vocabulary size V (paper: 201088)",
    "hidden": "hidden size H (paper: 2880)",
    "k": "teacher top-K per token",
    "dtype": "float32 | bfloat16 | float16",
    "device": "cpu | cuda",
    "repeats": "timed runs per point (median), after one measured warm run",
    "mem_limit_gib": "CPU address-space cap per point, so OOM is a clean result (0: none)",
    "timeout_s": "seconds before a point is recorded as a timeout",
    "out": "output directory for loss.csv, loss.json, loss.png",
    "no_huge_pages": "time without THP_MEM_ALLOC_ENABLE=1 (torch huge-page CPU allocator; memory never uses it)",
    "report_only": "re-print the table of the run stored in --out, measuring nothing",
}
# list flags that take space-separated values (shell globs); others are comma-separated
MANY_VALUES = {"data", "text", "choices"}


def _list_of(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, helps: dict) -> None:
    """One flag per dataclass field, same name (dashes), same default."""
    default = cls()
    for f in fields(cls):
        value = getattr(default, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, dest=f.name, action="store_true", help=helps[f.name])
            continue
        if f.name in MANY_VALUES:
            parser.add_argument(flag, dest=f.name, nargs="+", default=value, help=helps[f.name])
            continue
        item = {"list[int]": int, "list[float]": float}.get(str(f.type), str)
        kind = _list_of(item) if isinstance(value, list) else type(value)
        shown = ",".join(map(str, value)) if isinstance(value, list) else value
        parser.add_argument(flag, dest=f.name, type=kind, default=value,
                            help=f"{helps[f.name]} (default: {shown})")


def build_parser() -> argparse.ArgumentParser:
    import topkd

    parser = argparse.ArgumentParser(prog="topkd", description="memory-efficient LLM knowledge distillation",
                                     epilog="--debug anywhere on the line: a traceback instead of a one-line error")
    parser.add_argument("--version", action="version", version=f"topkd {topkd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    cache = sub.add_parser("cache", help="teacher top-K cache: build, verify, inspect")
    cache_sub = cache.add_subparsers(dest="cache", required=True)
    add_dataclass_flags(cache_sub.add_parser("build", help="run the teacher once and write its top-K cache"),
                        CacheBuildConfig, BUILD_HELP)
    verify = cache_sub.add_parser("verify", help="check every shard's size and sha256")
    verify.add_argument("path")
    inspect = cache_sub.add_parser("inspect", help="fingerprint, totals, bytes/token, top-K mass histogram")
    inspect.add_argument("path")
    inspect.add_argument("--plot", default="", help="also write the histogram as a PNG here")
    add_dataclass_flags(sub.add_parser("train", help="train a student against a top-K cache"), TrainConfig, TRAIN_HELP)
    add_dataclass_flags(sub.add_parser("eval", help="score a model: text bits/byte, KL to a teacher cache, "
                                                    "multiple choice"), EvalConfig, EVAL_HELP)
    add_dataclass_flags(sub.add_parser("demo", help="the whole pipeline on SmolLM2 + Shakespeare, one directory"),
                        DemoConfig, DEMO_HELP)
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    loss = bench_sub.add_parser("loss", help="projection-only KD loss: memory and time vs sequence length")
    add_dataclass_flags(loss, LossBenchConfig, BENCH_HELP)
    cache_bench = bench_sub.add_parser("cache", help="cache bytes/token, decode fidelity, build overhead")
    add_dataclass_flags(cache_bench, CacheBenchConfig, CACHE_BENCH_HELP)
    train_bench = bench_sub.add_parser("train", help="training step memory and time per loss impl; cache loading")
    add_dataclass_flags(train_bench, TrainBenchConfig, TRAIN_BENCH_HELP)
    model_bench = bench_sub.add_parser("model", help="cost model: predicted time, TFLOP/s and peak memory per impl "
                                                     "on a named device; --calibrate against bench loss here")
    add_dataclass_flags(model_bench, ModelBenchConfig, MODEL_BENCH_HELP)
    return parser


def _config(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A refusal (bad flag, bad input, refused cache, full disk) is one line
    `topkd <cmd>: error: ...` and exit code 2; a signal stops the job cleanly with 128 + signum;
    --debug (anywhere on the line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args = build_parser().parse_args(argv)
    sub = {"cache": getattr(args, "cache", None), "bench": getattr(args, "bench", None)}.get(args.command)
    name = f"{args.command} {sub}" if sub else args.command
    try:
        with signals_raise():
            return run_command(args)
    except Interrupted as e:
        print(f"topkd {name}: {e.message}", file=sys.stderr, flush=True)
        return 128 + e.signum
    except (ValueError, OSError) as e:  # CacheError is a ValueError; OSError: missing file, full disk, ...
        if debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"topkd {name}: error: {message}", file=sys.stderr, flush=True)
        return 2


def run_command(args) -> int:
    if args.command == "bench" and args.bench == "loss":
        run_loss_bench(_config(LossBenchConfig, args))
    elif args.command == "bench" and args.bench == "cache":
        run_cache_bench(_config(CacheBenchConfig, args))
    elif args.command == "bench" and args.bench == "train":
        run_train_bench(_config(TrainBenchConfig, args))
    elif args.command == "bench" and args.bench == "model":
        run_model_bench(_config(ModelBenchConfig, args))
    elif args.command == "demo":
        from topkd.demo import run_demo

        run_demo(_config(DemoConfig, args))
    elif args.command == "eval":
        from topkd.eval import run_eval

        run_eval(_config(EvalConfig, args))
    elif args.command == "train":
        from topkd.train import train

        train(_config(TrainConfig, args))
    elif args.command == "cache" and args.cache == "build":
        build(_config(CacheBuildConfig, args))
    elif args.command == "cache" and args.cache == "verify":
        return verify_cache(args.path)
    elif args.command == "cache" and args.cache == "inspect":
        inspect_cache(args.path, plot=args.plot or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
