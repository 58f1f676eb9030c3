"""`topkd cache build`: run a teacher once over token data and write its top-K cache.

    topkd cache build --teacher MODEL_DIR_OR_GGUF --data a.txt b.jsonl --out CACHE --seq-len 2048 --k 100
    torchrun --nproc_per_node 2 -m topkd.cli cache build ...      # rank r builds shards j = r mod world

Resumable: shards whose sidecar verifies are skipped, so killing the build at any moment and
rerunning the same command continues and yields the same bytes as an uninterrupted run.
The manifest is written last by rank 0; a cache without it is refused by the reader.
"""
from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from topkd import dist
from topkd.cache import manifest as mf
from topkd.cache.adaptive import adaptive_rows
from topkd.cache.compat import TOKENIZER_DIR, save_teacher_tokenizer
from topkd.cache.repair import check_or_repair, finished, remove_stale_temps
from topkd.cache.sampled import Sampler, sampling_seed
from topkd.cache.shard import CODECS, DEFAULT_CODEC, TeacherSequence, encode_shard, write_shard
from topkd.cache.teacher import Teacher, load_teacher
from topkd.cache.vllm_engine import VLLMTeacher
from topkd.checks import require_device, require_dtype, require_ints, require_path
from topkd.data.chat import check_chat_tokenizer, check_train_on
from topkd.data.documents import chat_roles, check_paths, iter_documents, pack_sequences
from topkd.files import exclusive_lock, file_sha256, refuse_links
from topkd.models import model_positions
from topkd.progress import count, progress, skipped
from topkd.signals import Interrupted

TARGETS = ("topk", "sampled", "topp")


def row_width(cfg) -> int:
    """Entries per cached row: K for top-K targets, N (the draws: the most distinct ids a row can hold) sampled."""
    return cfg.samples + cfg.head if cfg.targets == "sampled" else cfg.k


@dataclass
class CacheBuildConfig:
    teacher: str = ""
    data: list[str] = field(default_factory=list)
    out: str = ""
    seq_len: int = 2048
    k: int = 100
    targets: str = "topk"
    samples: int = 50
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
    "k": "top-K log-probs kept per token",
    "targets": "topk (the teacher's K most likely ids, exact, the rest one tail bucket) | sampled (--samples N "
               "draws per token from the teacher's softmax: the distinct ids with count / N, an unbiased estimate "
               "of the full distribution) | topp (adaptive top-K: --top-p, --min-k); the last two: cache format 5",
    "samples": "--targets sampled: draws per token (with replacement; about a quarter come out distinct)",
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
        raise ValueError(f"expected --teacher and --out, got teacher={cfg.teacher!r} out={cfg.out!r}")
    if not os.path.exists(cfg.teacher):
        raise ValueError(f"teacher: expected a local model directory or .gguf file, got {cfg.teacher!r} (not found); "
                         "download the model first, topkd never fetches from a hub")
    require_device(cfg.device)
    check_positions(model_positions(cfg.teacher), cfg.seq_len)  # config.json or GGUF header: before loading
    check_paths(cfg.data)
    if cfg.codec not in CODECS:
        raise ValueError(f"codec: expected one of {CODECS}, got {cfg.codec!r}")
    require_ints(cfg, ("seq_len", "k", "seqs_per_shard", "batch_size"), 1)
    require_ints(cfg, ("max_sequences",), 0)
    if cfg.targets not in TARGETS:
        raise ValueError(f"targets: expected one of {TARGETS}, got {cfg.targets!r}")
    require_ints(cfg, ("samples",), 1)
    require_ints(cfg, ("head",), 0)
    if cfg.head and cfg.targets != "sampled":
        raise ValueError(f"--head: expected only with --targets sampled, got --head {cfg.head} with --targets "
                         f"{cfg.targets}; --k sets a top-K cache's width")
    if cfg.targets == "topp" and not (0 < cfg.top_p <= 1 and isinstance(cfg.min_k, int) and 1 <= cfg.min_k <= cfg.k):
        raise ValueError(f"--targets topp: expected 0 < --top-p <= 1 and 1 <= --min-k <= --k, got top_p={cfg.top_p} "
                         f"min_k={cfg.min_k} k={cfg.k}")
    if cfg.targets == "sampled" and (cfg.temperatures or cfg.engine != "hf"):
        raise ValueError(f"--targets sampled: expected --engine hf and no --temperatures, got engine={cfg.engine!r} "
                         f"temperatures={cfg.temperatures}; the draws are from the teacher at T = 1 (counts carry "
                         "no c_T), and vLLM returns only a top-K to draw from")
    if any(not t > 0 for t in cfg.temperatures):
        raise ValueError(f"temperatures: expected values > 0, got {cfg.temperatures}")
    require_dtype(cfg.dtype)
    check_train_on(cfg.train_on)
    if cfg.chat_template:
        require_path("--chat-template", cfg.chat_template, "file")
    if cfg.engine not in ("hf", "vllm"):
        raise ValueError(f"engine: expected hf | vllm, got {cfg.engine!r}")
    require_ints(cfg, ("tensor_parallel", "parts"), 1)
    if not 0 <= cfg.part < cfg.parts:
        raise ValueError(f"part: expected 0 <= part < parts={cfg.parts}, got {cfg.part}")
    if cfg.engine == "vllm" and cfg.temperatures:
        raise ValueError(f"--engine vllm: expected no --temperatures, got {cfg.temperatures}; vLLM returns only the "
                         "top-K, so c_T over the full vocabulary cannot be computed; use --engine hf, or train with "
                         "--tail renorm (needs no c_T)")
    if cfg.engine == "vllm" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--engine vllm: expected one process (vLLM runs its own tensor-parallel workers), got "
                         f"WORLD_SIZE={os.environ['WORLD_SIZE']}; run it without torchrun, one build per node "
                         "with --part/--parts, or use --engine hf under torchrun")


def build(cfg: CacheBuildConfig) -> dict:
    """Build (or resume, or repair) the cache in cfg.out; returns the manifest."""
    check_config(cfg)
    rank, world = dist.init(cfg.device) if cfg.engine == "hf" else (0, 1)
    teacher = load_teacher(cfg.teacher, cfg.dtype, dist.local_device(cfg.device)) if cfg.engine == "hf" else \
        VLLMTeacher(cfg.teacher, cfg.k, cfg.dtype, cfg.tensor_parallel, cfg.seq_len)
    check_teacher_fits(teacher, cfg)
    me, builders = cfg.part * world + rank, cfg.parts * world
    total = _count_tokens(teacher, cfg, me, builders)  # also refuses empty or out-of-vocabulary data
    refuse_links(cfg.out, ["shards", mf.MANIFEST, TOKENIZER_DIR])
    os.makedirs(os.path.join(cfg.out, "shards"), exist_ok=True)  # only once the inputs are known to be usable
    with build_lock(cfg.out, f"{cfg.part}-{rank}"):
        fingerprint = teacher.fingerprint(row_width(cfg), tuple(cfg.temperatures))
        build_info = _build_info(cfg, teacher)
        build_hash = mf.build_hash(fingerprint, build_info)
        if rank == 0 and cfg.part == 0:
            check_or_repair(cfg.out, build_hash)  # leaves manifest.json only when complete and verified
        dist.barrier()
        existing = finished(cfg.out, build_hash)
        if existing is not None:
            done = existing["totals"]
            print(f"cache build: {cfg.out} is already complete and verified ({count(done['shards'], 'shard')}, "
                  f"{count(done['tokens'], 'token')}); nothing to do", flush=True)
            return existing
        try:
            n_shards = _build_shards(teacher, cfg, build_hash, me, builders, total)
        except Interrupted as e:
            raise Interrupted(e.signum, f"stopped by {signal.Signals(e.signum).name}: the shard in flight was "
                              "dropped, finished shards are kept; rerun the same command to resume") from None
        dist.barrier()
        if cfg.parts > 1:
            print(f"part {cfg.part} of {cfg.parts} done; when every part is, rerun this command with --parts 1 to "
                  "write the manifest", flush=True)
            return {}
        if rank != 0:
            return {}
        sidecars = [mf.done_shard(cfg.out, j, build_hash) for j in range(n_shards)]
        missing = [j for j, s in enumerate(sidecars) if s is None]
        if missing:
            raise mf.CacheError(f"shards {missing[:10]} are missing or failed verification; rerun the same command")
        tokenizer_files = save_teacher_tokenizer(cfg.out, teacher.tokenizer)
        manifest = mf.write_manifest(cfg.out, fingerprint, build_info, sidecars, tokenizer_files)
    totals = manifest["totals"]
    print(f"cache build: wrote {count(totals['shards'], 'shard')}, {count(totals['sequences'], 'sequence')}, "
          f"{count(totals['tokens'], 'token')}, {totals['bytes'] / 1e6:.2f} MB ({totals['bytes_per_token']:.1f} "
          f"bytes/token) to {cfg.out}", flush=True)
    return manifest


def check_teacher_fits(teacher, cfg: CacheBuildConfig) -> None:
    """Settings the teacher itself bounds: K within its vocabulary, sequences within its positions, a chat
    template its tokenizer can render conversations with (--chat-template replaces its own)."""
    if cfg.chat_template:
        check_chat_tokenizer(teacher.tokenizer, cfg.chat_template)
    if not 1 <= row_width(cfg) <= teacher.vocab:
        name = "samples" if cfg.targets == "sampled" else "k"
        raise ValueError(f"{name}: expected 1 <= {name} <= vocab size {teacher.vocab}, got {row_width(cfg)}")
    config = getattr(getattr(teacher, "model", None), "config", None)
    check_positions(getattr(config, "max_position_embeddings", None), cfg.seq_len)


def check_positions(limit: int | None, seq_len: int) -> None:
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"seq_len: expected at most the teacher's {limit} positions (max_position_embeddings), got "
                         f"{seq_len}; use --seq-len {limit} or less")


def build_lock(out: str, who: str):
    """One build process per (part, rank) of an --out: a second identical build is refused at once, never
    left to delete or overwrite the first one's files."""
    return exclusive_lock(os.path.join(out, f".build-{who}.lock"),
                          f"{out}: another build is writing there (process {{holder}} holds {{path}}); wait for it "
                          "to finish, or build into another --out")


def _build_shards(teacher: Teacher, cfg: CacheBuildConfig, build_hash: str, rank: int, world: int, total: int) -> int:
    bar = progress(total=total, desc=f"cache build (rank {rank})" if world > 1 else "cache build", unit="tok")
    written, start, n_shards = 0, time.perf_counter(), 0
    try:
        for j, group in enumerate(_batched(_sequences(teacher, cfg), cfg.seqs_per_shard)):
            n_shards = j + 1
            tokens = sum(len(s.tokens) for s in group)
            if j % world != rank or mf.done_shard(cfg.out, j, build_hash) is not None:
                skipped(bar, tokens if j % world == rank else 0)  # done before: not part of this run's rate
                continue
            remove_stale_temps(cfg.out, j)
            rows = [teacher_sequence(s, _adapted(cfg, r)) for s, r in zip(group, teacher.sequence_rows(
                group, row_width(cfg), tuple(cfg.temperatures), cfg.batch_size, on_batch=bar.update,  # per batch
                sampler=_sampler(cfg, teacher, build_hash, j)))]
            first = group[0].index
            identity = {"build_hash": build_hash, "shard": j, "sequences": f"{first},{first + len(group)}"}
            arrays, meta = encode_shard(rows, vocab=teacher.vocab, codec_name=cfg.codec, identity=identity,
                                        temperatures=tuple(cfg.temperatures), variable_k=cfg.targets != "topk",
                                        samples=cfg.samples if cfg.targets == "sampled" and not cfg.head else None)
            nbytes = write_shard(mf.shard_path(cfg.out, j), arrays, meta)
            mf.write_sidecar(cfg.out, j, nbytes, first, len(group), tokens, build_hash, **shard_facts(rows, meta))
            written += nbytes
            bar.set_postfix(shards=n_shards, MB=f"{written / 1e6:.1f}", B_per_tok=f"{nbytes / tokens:.0f}",
                            s=f"{time.perf_counter() - start:.0f}")
    finally:  # an error or a signal mid-build: the bar's timer stops with it
        bar.close()
    return n_shards


def _adapted(cfg: CacheBuildConfig, rows: dict) -> dict:
    """--targets topp: the rows cut to mass --top-p (topkd/cache/adaptive.py); other targets as they come."""
    return adaptive_rows(rows, cfg.top_p, cfg.min_k, tuple(cfg.temperatures)) if cfg.targets == "topp" else rows


def _sampler(cfg: CacheBuildConfig, teacher, build_hash: str, j: int):
    """--targets sampled: shard j's own seeded generator (a redone shard draws exactly what it drew before)."""
    if cfg.targets != "sampled":
        return None
    device = getattr(getattr(teacher, "model", None), "device", torch.device("cpu"))
    return Sampler(torch.Generator(device=device).manual_seed(sampling_seed(build_hash, j)), cfg.samples, cfg.head)


def _sequences(teacher, cfg: CacheBuildConfig):
    """The packed sequences of the build's data."""
    docs = iter_documents(cfg.data, teacher.tokenizer, cfg.text_field, vocab=teacher.vocab,
                          messages_field=cfg.messages_field, train_on=cfg.train_on)
    seqs = pack_sequences(docs, cfg.seq_len, teacher.tokenizer.eos_token_id)
    return itertools.islice(seqs, cfg.max_sequences) if cfg.max_sequences else seqs


def _count_tokens(teacher, cfg: CacheBuildConfig, rank: int, world: int) -> int:
    """A tokenising pass before the teacher runs: this rank's total for the progress bar and ETA, and a refusal
    of data with no tokens but separators, or chat data with no target (which would make a cache that trains on
    nothing); the number of chat targets is printed."""
    separator, total, content, counted, masked = teacher.tokenizer.eos_token_id, 0, False, 0, False
    for j, group in enumerate(_batched(_sequences(teacher, cfg), cfg.seqs_per_shard)):
        total += sum(len(s.tokens) for s in group) if j % world == rank else 0
        content = content or any(bool((s.tokens != separator).any()) for s in group)
        masked = masked or any(s.row_mask is not None for s in group)
        counted += sum(len(s.tokens) if s.row_mask is None else int(s.row_mask.sum()) for s in group)
    if not content:
        raise ValueError(f"data: expected some text, got no tokens in {cfg.data} (empty files, or JSONL lines with "
                         "empty text); check the inputs")
    if masked and not counted:
        seen = chat_roles(cfg.data, cfg.messages_field)
        roles = ", ".join(f"{r!r} x{n}" for r, n in seen.most_common(8))
        why = ("the chat template renders none of their text" if "assistant" in seen else
               "rename the replies' role to 'assistant'")
        raise ValueError(f"chat data: expected assistant turns to train on (role 'assistant'), got none in "
                         f"{cfg.data} (roles seen: {roles}); {why}, or pass --train-on all")
    if masked and rank == 0:
        print(f"cache build: chat data: {counted} of the data's tokens are training targets ({cfg.train_on} turns); "
              "the rest is context", flush=True)
    return total


def shard_facts(rows: list[TeacherSequence], meta: dict) -> dict:
    """What a sidecar records beside the checksum: the largest token id, the format version, counted rows."""
    real = lambda r: r.ids[~np.isneginf(r.logprobs)]  # noqa: E731  (padding ids are never read)
    return {"max_id": max(max(int(real(r).max()), int(r.input_ids.max())) for r in rows),
            "format_version": int(meta["format_version"]),
            "counted": sum(len(r) if r.row_mask is None else int(r.row_mask.sum()) for r in rows)}


def teacher_sequence(seq, rows: dict) -> TeacherSequence:
    """One packed sequence and its teacher rows (from a TeacherEngine), as the shard encoder takes them."""
    return TeacherSequence(input_ids=seq.tokens, ids=rows["ids"], logprobs=rows["logprobs"],
                           log_mass=rows["log_mass"], log_tail=rows["log_tail"], logz=rows["logz"],
                           doc_starts=seq.doc_starts, source_index=seq.index, token_offset=seq.token_offset,
                           log_mass_t=rows.get("log_mass_t"), row_mask=seq.row_mask)


def _batched(iterable, n: int):
    it = iter(iterable)
    while group := list(itertools.islice(it, n)):
        yield group


def _build_info(cfg: CacheBuildConfig, teacher: Teacher) -> dict:
    """Everything besides the teacher that decides the cache's bytes: data files and settings."""
    data = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": file_sha256(p)} for p in cfg.data]
    keep = {k: v for k, v in asdict(cfg).items() if k in ("seq_len", "codec", "seqs_per_shard", "max_sequences",
                                                             "text_field")}
    defaults = CacheBuildConfig()  # chat settings only when changed: plain caches keep their build hash
    keep.update({k: getattr(cfg, k) for k in ("messages_field", "train_on") if getattr(cfg, k) != getattr(defaults, k)})
    if cfg.targets == "sampled":  # top-K caches keep their build hash
        keep["targets"] = {"kind": "sampled", "samples": cfg.samples, "temperature": 1.0,
                           **({"head": cfg.head} if cfg.head else {})}  # no head: the hash of earlier builds
    if cfg.targets == "topp":
        keep["targets"] = {"kind": "topp", "top_p": cfg.top_p, "min_k": cfg.min_k}
    if cfg.chat_template:
        keep["chat_template_sha256"] = file_sha256(cfg.chat_template)
    return {**keep, "data": data, "separator": teacher.tokenizer.eos_token_id}
