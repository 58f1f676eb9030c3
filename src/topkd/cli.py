"""The `topkd` command line: one command, subcommands per job.

    topkd cache build --teacher MODEL --data corpus.txt --out runs/cache --seq-len 2048  # sampled, N = 100
    topkd cache verify runs/cache          # every checksum
    topkd cache inspect runs/cache         # fingerprint, totals, bytes/token, kept mass and ids per token
    topkd train --cache runs/cache --init-from-teacher --layers 6 --out runs/student --steps 500
    topkd eval --model runs/student/final --text held_out.txt --cache runs/heldout-cache --choices mmlu.jsonl
    topkd demo [--quick]                   # the whole pipeline on SmolLM2 + Shakespeare, one output directory
    topkd bench loss [--lengths 1024,4096] [--vocab 32768] [--hidden 512] [--out DIR]
    topkd bench cache --teacher MODEL --data corpus.txt   # bytes/token, decode KL, build overhead
    topkd bench train [--lengths 4096,16384,32768]         # training step memory/time per impl, cache loading
    topkd bench model [--device h200] [--calibrate]        # cost model: predicted time/memory; vs bench loss here

Every subcommand is also a Python function (topkd.cache.build, topkd.cache.inspect_cache, topkd.train.train, ...).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Any, Callable

from topkd.base import dist
from topkd.base.signals import Interrupted, signals_raise
from topkd.bench.cache import CACHE_BENCH_HELP, CacheBenchConfig, run_cache_bench
from topkd.bench.loss import LOSS_BENCH_HELP, LossBenchConfig, run_loss_bench
from topkd.bench.model_command import MODEL_BENCH_HELP, ModelBenchConfig, run_model_bench
from topkd.bench.train import TRAIN_BENCH_HELP, TrainBenchConfig, run_train_bench
from topkd.cache.building.build import build
from topkd.cache.building.build_config import BUILD_HELP, CacheBuildConfig
from topkd.cache.reading.inspect import (
    INSPECT_HELP,
    VERIFY_HELP,
    InspectConfig,
    VerifyConfig,
    inspect_cache,
    verify_cache,
)
from topkd.cache.reading.interchange import (
    EXPORT_HELP,
    IMPORT_HELP,
    ExportConfig,
    ImportConfig,
    run_export,
    run_import,
)
from topkd.demo.run import DEMO_HELP, DemoConfig, run_demo
from topkd.eval.run import EVAL_HELP, EvalConfig, run_eval
from topkd.train import train
from topkd.train.config import TRAIN_HELP, TrainConfig

# list flags that take space-separated values (shell globs); others are comma-separated
MANY_VALUES = {"data", "text", "choices"}


@dataclass(frozen=True)
class Command:
    """One subcommand: its words, its config dataclass (one flag per field) with a help per field, its runner."""

    words: tuple[str, ...]
    help: str
    config: type
    flag_help: dict
    run: Callable[[Any], Any]  # an int result is the exit status (verify); anything else means 0


def _run_inspect(cfg: InspectConfig) -> None:
    inspect_cache(cfg.path, plot=cfg.plot or None)


COMMANDS = (
    Command(
        ("cache", "build"),
        "run the teacher once and write its top-K cache",
        CacheBuildConfig,
        BUILD_HELP,
        build,
    ),
    Command(
        ("cache", "verify"),
        "check every shard's size and sha256",
        VerifyConfig,
        VERIFY_HELP,
        lambda cfg: verify_cache(cfg.path),
    ),
    Command(
        ("cache", "inspect"),
        "fingerprint, totals, bytes/token, top-K mass histogram",
        InspectConfig,
        INSPECT_HELP,
        _run_inspect,
    ),
    Command(
        ("cache", "export"),
        "write the cache as another trainer's data set (axolotl: Parquet, KD columns)",
        ExportConfig,
        EXPORT_HELP,
        run_export,
    ),
    Command(
        ("cache", "import"),
        "a cache from another trainer's KD data set (axolotl); the tail is unknown",
        ImportConfig,
        IMPORT_HELP,
        run_import,
    ),
    Command(
        ("train",),
        "train a student against a top-K cache (or an online teacher)",
        TrainConfig,
        TRAIN_HELP,
        train,
    ),
    Command(
        ("eval",),
        "score a model: text bits/byte, KL to a teacher cache, multiple choice",
        EvalConfig,
        EVAL_HELP,
        run_eval,
    ),
    Command(
        ("demo",),
        "the whole pipeline on SmolLM2 + Shakespeare, one directory",
        DemoConfig,
        DEMO_HELP,
        run_demo,
    ),
    Command(
        ("bench", "loss"),
        "projection-only KD loss: memory and time vs sequence length",
        LossBenchConfig,
        LOSS_BENCH_HELP,
        run_loss_bench,
    ),
    Command(
        ("bench", "cache"),
        "cache bytes/token, decode fidelity, build overhead",
        CacheBenchConfig,
        CACHE_BENCH_HELP,
        run_cache_bench,
    ),
    Command(
        ("bench", "train"),
        "training step memory and time per loss impl; cache loading",
        TrainBenchConfig,
        TRAIN_BENCH_HELP,
        run_train_bench,
    ),
    Command(
        ("bench", "model"),
        "cost model: predicted time, TFLOP/s and peak memory per impl on a named device; "
        "--calibrate against bench loss here",
        ModelBenchConfig,
        MODEL_BENCH_HELP,
        run_model_bench,
    ),
)
GROUPS = {
    "cache": "teacher top-K cache: build, verify, inspect, export, import",
    "bench": "benchmarks that record ratios measured in one run",
}


def _list_of(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, helps: dict) -> None:
    """One flag per dataclass field, same name (dashes), same default; a field marked positional is an argument."""
    default = cls()
    for f in fields(cls):
        value = getattr(default, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.metadata.get("positional"):
            parser.add_argument(f.name, help=helps[f.name])
        elif isinstance(value, bool):
            parser.add_argument(flag, dest=f.name, action="store_true", help=helps[f.name])
        elif f.name in MANY_VALUES:
            parser.add_argument(flag, dest=f.name, nargs="+", default=value, help=helps[f.name])
        else:
            item = {"list[int]": int, "list[float]": float}.get(str(f.type), str)
            kind = _list_of(item) if isinstance(value, list) else type(value)
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            # required, or the help says it in words
            said = shown in ("", None) or "(default" in helps[f.name]
            parser.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=value,
                help=helps[f.name] + ("" if said else f" (default: {shown})"),
            )


def build_parser() -> argparse.ArgumentParser:
    import topkd

    # --step is not --steps: a typo is refused, not guessed
    parser = argparse.ArgumentParser(
        prog="topkd",
        description="memory-efficient LLM knowledge distillation",
        epilog="--debug anywhere on the line: a traceback instead of a one-line error",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"topkd {topkd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    groups = {}
    for cmd in COMMANDS:
        if len(cmd.words) == 1:
            command = sub.add_parser(cmd.words[0], help=cmd.help, allow_abbrev=False)
        else:
            if cmd.words[0] not in groups:
                group = sub.add_parser(cmd.words[0], help=GROUPS[cmd.words[0]], allow_abbrev=False)
                groups[cmd.words[0]] = group.add_subparsers(dest="subcommand", required=True)
            command = groups[cmd.words[0]].add_parser(
                cmd.words[1], help=cmd.help, allow_abbrev=False
            )
        add_dataclass_flags(command, cmd.config, cmd.flag_help)
        # argparse has no public API
        command.set_defaults(which=cmd, flags=sorted(command._option_string_actions))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A refusal (bad flag, bad input, refused cache, full disk) is one line
    `topkd <cmd>: error: ...` and exit code 2; a signal stops the job cleanly with 128 + signum;
    --debug (anywhere on the line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args, unknown = build_parser().parse_known_args(argv)
    name = " ".join(args.which.words)
    # argparse would answer with the top-level usage: name the subcommand and the nearest flag
    if unknown:
        print(
            f"topkd {name}: error: {unknown_flags(unknown, args.flags)}; `topkd {name} --help` lists every flag",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:
        with signals_raise():
            return run_command(args)
    except Interrupted as e:
        print(f"topkd {name}: {e.message}", file=sys.stderr, flush=True)
        return 128 + e.signum
    # CacheError is a ValueError; OSError: missing file, full disk, ...
    except (ValueError, OSError) as e:
        if debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"topkd {name}: error: {message}", file=sys.stderr, flush=True)
        return 2


def unknown_flags(unknown: list[str], flags: list[str]) -> str:
    """What was not understood, with a "did you mean" for the first unknown flag."""
    import difflib

    first = next((a.split("=", 1)[0] for a in unknown if a.startswith("-")), "")
    guess = difflib.get_close_matches(first, flags, n=1, cutoff=0.6) if first else []
    hint = f"; did you mean {guess[0]}?" if guess else ""
    return f"expected only this command's flags, got unrecognized {' '.join(unknown)}{hint}"


def run_command(args) -> int:
    cmd = args.which
    status = cmd.run(cmd.config(**{f.name: getattr(args, f.name) for f in fields(cmd.config)}))
    dist.shutdown()  # under torchrun: the ranks leave together
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
