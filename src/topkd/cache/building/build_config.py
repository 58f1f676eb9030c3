"""What `topkd cache build` is told: its settings (CacheBuildConfig, with the CLI's help), and their checks.

    cfg = CacheBuildConfig(teacher="MODEL_DIR", data=["a.txt"], out="CACHE", k=100)
    check_config(cfg)          # one clear line for each setting that cannot work, before a teacher loads

The build itself is topkd/cache/building/build.py; the teacher engines --engine names, topkd/cache/building/engines.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from topkd.base.checks import require_device, require_dtype, require_ints, require_path
from topkd.cache.building.engines import ENGINES
from topkd.cache.format.shard import CODECS, DEFAULT_CODEC
from topkd.cache.format.targets import TARGET_KINDS, target_kind
from topkd.data.chat import check_train_on
from topkd.data.documents import check_paths
from topkd.models import model_positions


def row_width(cfg) -> int:
    """Entries per cached row: K for top-K targets, N (the draws: the most distinct ids a row can hold) sampled."""
    return target_kind(cfg.targets).row_width(cfg)


@dataclass
class CacheBuildConfig:
    teacher: str = ""
    data: list[str] = field(default_factory=list)
    out: str = ""
    seq_len: int = 2048
    k: int = 100
    targets: str = "sampled"  # docs/results.md: the decision, and the runs behind it
    samples: int = 100
    head: int = 0
    top_p: float = 0.95
    min_k: int = 1
    temperatures: list[float] = field(default_factory=list)
    codec: str = DEFAULT_CODEC
    seqs_per_shard: int = 64
    batch_size: int = 4
    max_sequences: int = 0
    text_field: str = "text"
    messages_field: str = "messages"
    train_on: str = "assistant"
    chat_template: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    engine: str = "hf"
    tensor_parallel: int = 1
    part: int = 0
    parts: int = 1


BUILD_HELP = {
    "teacher": "teacher: a local Hugging Face model directory, or a .gguf file",
    "data": "input files: .txt (one document each), .jsonl (one document per line), .npy (token ids)",
    "out": "cache directory (created; a rerun with the same arguments resumes)",
    "seq_len": "tokens per sequence (documents are packed, EOS-separated; the last sequence may be shorter)",
    "k": "--targets topk / topp: top-K log-probs kept per token",
    "targets": " | ".join(kind.help for kind in TARGET_KINDS.values()),
    "samples": "--targets sampled: draws per token (with replacement; 50 draws gave 21.9 distinct ids per token "
    "on SmolLM2 over Hamlet)",
    "head": "--targets sampled: keep this many most likely ids exact and draw --samples from the rest (a hybrid)",
    "top_p": "--targets topp: keep per token the fewest of the top-K entries whose mass reaches this (the rest "
    "join the exact tail bucket)",
    "min_k": "--targets topp: entries kept per token at least",
    "temperatures": "comma-separated T values whose normaliser c_T is stored per token (tempered bucket KD)",
    "codec": "rice-zstd (Rice-coded sorted-id gaps + uint8 log-probs, zstd per sequence; smallest) | rice | "
    "packed (ceil(log2 V) bits per id, fixed bytes per token)",
    "seqs_per_shard": "sequences per shard file (the unit of work a crash can lose)",
    "batch_size": "sequences per teacher forward",
    "max_sequences": "stop after this many sequences (0: all of the data)",
    "text_field": "JSONL field holding the text",
    "messages_field": "JSONL field holding a conversation ([{role, content}, ...]): rendered with the teacher's chat "
    "template, one conversation per document",
    "train_on": "chat data: assistant (only assistant turns and their end-of-turn token count for KD and CE; the "
    "teacher still reads the whole conversation) | all",
    "chat_template": "a Jinja chat template file to render conversations with (default: the teacher tokenizer's)",
    "dtype": "teacher weights dtype: float32 | bfloat16 | float16 (the lm_head math is always fp32)",
    "device": "cpu | cuda (under torchrun: cuda:LOCAL_RANK)",
    "engine": "hf (transformers, any device, torchrun data-parallel) | vllm (vLLM in its own environment, see "
    "docs/scale-out.md: one process serving the teacher over --tensor-parallel GPUs; no --temperatures)",
    "tensor_parallel": "--engine vllm: GPUs the teacher is split across",
    "part": "with --parts W: this build writes shards j with j mod W == part (one machine of a fleet)",
    "parts": "independent builds sharing --out (e.g. one per node, any scheduler); when all are done, rerun with "
    "--parts 1 to write the manifest (finished shards are kept, not recomputed)",
}


def check_config(cfg: CacheBuildConfig) -> None:
    if not cfg.teacher or not cfg.out:
        raise ValueError(
            f"expected --teacher and --out, got teacher={cfg.teacher!r} out={cfg.out!r}"
        )
    if not os.path.exists(cfg.teacher):
        raise ValueError(
            f"teacher: expected a local model directory or .gguf file, got {cfg.teacher!r} (not found); "
            "download the model first, topkd never fetches from a hub"
        )
    require_device(cfg.device)
    # config.json or GGUF header: before loading
    check_positions(model_positions(cfg.teacher), cfg.seq_len)
    check_paths(cfg.data)
    if cfg.codec not in CODECS:
        raise ValueError(f"codec: expected one of {CODECS}, got {cfg.codec!r}")
    require_ints(cfg, ("seq_len", "k", "seqs_per_shard", "batch_size"), 1)
    require_ints(cfg, ("max_sequences",), 0)
    _check_targets(cfg)
    require_dtype(cfg.dtype)
    check_train_on(cfg.train_on)
    if cfg.chat_template:
        require_path("--chat-template", cfg.chat_template, "file")
    require_ints(cfg, ("tensor_parallel", "parts"), 1)
    if not 0 <= cfg.part < cfg.parts:
        raise ValueError(f"part: expected 0 <= part < parts={cfg.parts}, got {cfg.part}")
    _check_engine(cfg)


def _check_targets(cfg: CacheBuildConfig) -> None:
    kind = target_kind(cfg.targets)
    require_ints(cfg, ("samples",), 1)
    require_ints(cfg, ("head",), 0)
    _refuse_ignored_flags(cfg, kind)
    kind.check(cfg)
    if any(not t > 0 for t in cfg.temperatures):
        raise ValueError(f"temperatures: expected values > 0, got {cfg.temperatures}")


def _refuse_ignored_flags(cfg: CacheBuildConfig, kind) -> None:
    """Another kind's setting changed from its default would be ignored by this build: refused instead."""
    defaults = CacheBuildConfig()
    for name in dict.fromkeys(flag for other in TARGET_KINDS.values() for flag in other.flags):
        value = getattr(cfg, name)
        if name in kind.flags or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        readers = " or ".join(other.name for other in TARGET_KINDS.values() if name in other.flags)
        raise ValueError(
            f"{flag}: expected only with --targets {readers}, got {flag} {value} with --targets {cfg.targets}, "
            f"which would ignore it; drop {flag}, or pass --targets {readers.split()[0]}"
        )


def _check_engine(cfg: CacheBuildConfig) -> None:
    """What the chosen engine can do (topkd/cache/building/engines.py) against what the settings ask of it."""
    if cfg.engine not in ENGINES:
        raise ValueError(f"engine: expected one of {' | '.join(ENGINES)}, got {cfg.engine!r}")
    engine = ENGINES[cfg.engine]
    if target_kind(cfg.targets).draws and (cfg.temperatures or not engine.full_vocabulary):
        raise ValueError(
            f"--targets {cfg.targets}: expected --engine hf and no --temperatures, got engine={cfg.engine!r} "
            f"temperatures={cfg.temperatures}; the draws are from the teacher at T = 1 (counts carry "
            "no c_T), and an engine that returns only a top-K has nothing to draw from; pass --targets topk "
            "(--k 100) for tempered targets or that engine"
        )
    if not engine.full_vocabulary and cfg.temperatures:
        raise ValueError(
            f"--engine {cfg.engine}: expected no --temperatures, got {cfg.temperatures}; it returns only "
            "the top-K, so c_T over the full vocabulary cannot be computed; use --engine hf, or train "
            "with --tail renorm (needs no c_T)"
        )
    if not engine.distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"--engine {cfg.engine}: expected one process (it runs its own tensor-parallel workers), "
            f"got WORLD_SIZE={os.environ['WORLD_SIZE']}; run it without torchrun, one build per node "
            "with --part/--parts, or use --engine hf under torchrun"
        )


def check_positions(limit: int | None, seq_len: int) -> None:
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(
            f"seq_len: expected at most the teacher's {limit} positions (max_position_embeddings), got "
            f"{seq_len}; use --seq-len {limit} or less"
        )
