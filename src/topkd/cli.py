"""The `topkd` command line: one command, subcommands per job.

    topkd bench loss [--lengths 1024,4096] [--vocab 32768] [--hidden 512] [--out DIR]

Every subcommand is also a Python function (here: topkd.bench.loss.run_loss_bench).
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from topkd.bench.loss import LossBenchConfig, run_loss_bench

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
    "no_huge_pages": "do not set THP_MEM_ALLOC_ENABLE=1 (torch's huge-page CPU allocator) for the points",
    "report_only": "re-print the table and targets of the run stored in --out, measuring nothing",
}


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
        kind = _list_of(int if f.name == "lengths" else str) if isinstance(value, list) else type(value)
        shown = ",".join(map(str, value)) if isinstance(value, list) else value
        parser.add_argument(flag, dest=f.name, type=kind, default=value,
                            help=f"{helps[f.name]} (default: {shown})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="topkd", description="memory-efficient LLM knowledge distillation")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    loss = bench_sub.add_parser("loss", help="projection-only KD loss: memory and time vs sequence length")
    add_dataclass_flags(loss, LossBenchConfig, BENCH_HELP)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "loss":
        cfg = LossBenchConfig(**{f.name: getattr(args, f.name) for f in fields(LossBenchConfig)})
        run_loss_bench(cfg)


if __name__ == "__main__":
    main()
