"""`topkd cache build`: run a teacher once over token data and write its top-K cache.

    topkd cache build --teacher MODEL_DIR_OR_GGUF --data a.txt b.jsonl --out CACHE --seq-len 2048
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
from dataclasses import asdict

import torch

from topkd.base import dist
from topkd.base.files import file_sha256, refuse_links
from topkd.base.progress import count, progress, skipped
from topkd.base.signals import Interrupted
from topkd.cache.building.build_config import (
    CacheBuildConfig,
    check_config,
    check_positions,
    row_width,
)
from topkd.cache.building.compat import TOKENIZER_DIR, save_teacher_tokenizer
from topkd.cache.building.engines import ENGINES
from topkd.cache.building.repair import build_lock, check_or_repair, finished, remove_stale_temps
from topkd.cache.building.teacher import TeacherEngine
from topkd.cache.format import manifest as mf
from topkd.cache.format.engine_rows import EngineRows, teacher_sequence
from topkd.cache.format.sampled import Sampler, sampling_seed
from topkd.cache.format.shard import encode_shard, shard_facts, write_shard
from topkd.cache.format.targets import target_kind
from topkd.data.chat import check_chat_tokenizer
from topkd.data.documents import chat_roles, iter_documents, pack_sequences, text_tokens_supported


def build(cfg: CacheBuildConfig) -> dict:
    """Build (or resume, or repair) the cache in cfg.out; returns the manifest."""
    check_config(cfg)
    rank, world, teacher = _start_engine(cfg)
    check_teacher_fits(teacher, cfg)
    if rank == 0 and cfg.part == 0:
        _say_targets(cfg)
    me, builders = cfg.part * world + rank, cfg.parts * world
    # also refuses empty or out-of-vocabulary data
    total = _count_tokens(teacher, cfg, me, builders)
    refuse_links(cfg.out, ["shards", mf.MANIFEST, TOKENIZER_DIR])
    # only once the inputs are known to be usable
    os.makedirs(os.path.join(cfg.out, "shards"), exist_ok=True)
    with build_lock(cfg.out, f"{cfg.part}-{rank}"):
        fingerprint = teacher.fingerprint(row_width(cfg), tuple(cfg.temperatures))
        build_info = _build_info(cfg, teacher)
        build_hash = mf.build_hash(fingerprint, build_info)
        if rank == 0 and cfg.part == 0:
            # leaves manifest.json only when complete and verified
            check_or_repair(cfg.out, build_hash)
        dist.barrier()
        existing = finished(cfg.out, build_hash)
        if existing is not None:
            done = existing["totals"]
            print(
                f"cache build: {cfg.out} is already complete and verified ({count(done['shards'], 'shard')}, "
                f"{count(done['tokens'], 'token')}); nothing to do",
                flush=True,
            )
            return existing
        try:
            n_shards = _build_shards(teacher, cfg, build_hash, me, builders, total)
        except Interrupted as e:
            raise Interrupted(
                e.signum,
                f"stopped by {signal.Signals(e.signum).name}: the shard in flight was "
                "dropped, finished shards are kept; rerun the same command to resume",
            ) from None
        dist.barrier()
        if cfg.parts > 1:
            print(
                f"part {cfg.part} of {cfg.parts} done; when every part is, rerun this command with --parts 1 "
                "to write the manifest",
                flush=True,
            )
        if cfg.parts > 1 or rank != 0:
            return {}
        return _write_manifest(cfg, teacher, fingerprint, build_info, build_hash, n_shards)


def _start_engine(cfg: CacheBuildConfig) -> tuple[int, int, TeacherEngine]:
    """This process's rank and the world (torchrun, for an engine that runs one process per rank), and the
    teacher loaded by the engine --engine names."""
    engine = ENGINES[cfg.engine]
    rank, world = dist.init(cfg.device) if engine.distributed else (0, 1)
    teacher = engine.load(
        cfg.teacher,
        dtype=cfg.dtype,
        device=dist.local_device(cfg.device),
        k=cfg.k,
        tensor_parallel=cfg.tensor_parallel,
        seq_len=cfg.seq_len,
    )
    return rank, world, teacher


def _write_manifest(
    cfg: CacheBuildConfig,
    teacher,
    fingerprint: dict,
    build_info: dict,
    build_hash: str,
    n_shards: int,
) -> dict:
    """Rank 0 of the last part: every shard verified, the tokenizer stored, the manifest written last."""
    sidecars = [mf.done_shard(cfg.out, j, build_hash) for j in range(n_shards)]
    missing = [j for j, s in enumerate(sidecars) if s is None]
    if missing:
        raise mf.CacheError(
            f"shards {missing[:10]} are missing or failed verification; rerun the same command"
        )
    tokenizer_files = save_teacher_tokenizer(cfg.out, teacher.tokenizer)
    manifest = mf.write_manifest(cfg.out, fingerprint, build_info, sidecars, tokenizer_files)
    totals = manifest["totals"]
    print(
        f"cache build: wrote {count(totals['shards'], 'shard')}, {count(totals['sequences'], 'sequence')}, "
        f"{count(totals['tokens'], 'token')}, {totals['bytes'] / 1e6:.2f} MB ({totals['bytes_per_token']:.1f} "
        f"bytes/token) to {cfg.out}",
        flush=True,
    )
    return manifest


def _say_targets(cfg: CacheBuildConfig) -> None:
    """One line naming the kind of target built: the default is sampled, so an old `--k 100` command says so."""
    kind = target_kind(cfg.targets)
    other = (
        " (--targets topk --k 100: the teacher's top-K, for temperatures and reverse KL)"
        if kind.draws
        else ""
    )
    print(f"cache build: {kind.label(cfg)} targets{other}", flush=True)


def check_teacher_fits(teacher, cfg: CacheBuildConfig) -> None:
    """Settings the teacher itself bounds: K within its vocabulary, sequences within its positions, a chat
    template its tokenizer can render conversations with (--chat-template replaces its own)."""
    if cfg.chat_template:
        check_chat_tokenizer(teacher.tokenizer, cfg.chat_template)
    if not 1 <= row_width(cfg) <= teacher.vocab:
        raise ValueError(
            f"{target_kind(cfg.targets).width_flags(cfg)}: expected at most the teacher's vocabulary of "
            f"{teacher.vocab} ids per row, got {row_width(cfg)}; lower it"
        )
    config = getattr(getattr(teacher, "model", None), "config", None)
    check_positions(getattr(config, "max_position_embeddings", None), cfg.seq_len)


def _build_shards(
    teacher: TeacherEngine,
    cfg: CacheBuildConfig,
    build_hash: str,
    rank: int,
    world: int,
    total: int,
) -> int:
    bar = progress(
        total=total, desc=f"cache build (rank {rank})" if world > 1 else "cache build", unit="tok"
    )
    written, start, n_shards = 0, time.perf_counter(), 0
    try:
        for j, group in enumerate(_batched(_sequences(teacher, cfg), cfg.seqs_per_shard)):
            n_shards = j + 1
            tokens = sum(len(s.tokens) for s in group)
            if j % world != rank or mf.done_shard(cfg.out, j, build_hash) is not None:
                # done before: not part of this run's rate
                skipped(bar, tokens if j % world == rank else 0)
                continue
            remove_stale_temps(cfg.out, j)
            nbytes = _write_one_shard(teacher, cfg, build_hash, j, group, tokens, bar.update)
            written += nbytes
            bar.set_postfix(
                shards=n_shards,
                MB=f"{written / 1e6:.1f}",
                B_per_tok=f"{nbytes / tokens:.0f}",
                s=f"{time.perf_counter() - start:.0f}",
            )
    finally:  # an error or a signal mid-build: the bar's timer stops with it
        bar.close()
    return n_shards


def _write_one_shard(
    teacher, cfg: CacheBuildConfig, build_hash: str, j: int, group: list, tokens: int, on_batch
):
    """Shard j: the teacher's rows of its sequences, encoded, written atomically, then its sidecar (the proof it is
    done). Returns its bytes."""
    kind = target_kind(cfg.targets)
    sampler = _sampler(cfg, teacher, build_hash, j)
    engine_rows = teacher.sequence_rows(
        group,
        row_width(cfg),
        tuple(cfg.temperatures),
        cfg.batch_size,
        on_batch=on_batch,
        sampler=sampler,
    )
    rows = [teacher_sequence(s, _adapted(cfg, r)) for s, r in zip(group, engine_rows)]
    first = group[0].index
    identity = {"build_hash": build_hash, "shard": j, "sequences": f"{first},{first + len(group)}"}
    arrays, meta = encode_shard(
        rows,
        vocab=teacher.vocab,
        codec_name=cfg.codec,
        identity=identity,
        temperatures=tuple(cfg.temperatures),
        variable_k=kind.variable_k,
        samples=kind.counts_of(cfg),
    )
    nbytes = write_shard(mf.shard_path(cfg.out, j), arrays, meta)
    facts = shard_facts(rows, meta)
    mf.write_sidecar(cfg.out, j, nbytes, first, len(group), tokens, build_hash, **facts)
    return nbytes


def _adapted(cfg: CacheBuildConfig, rows: EngineRows) -> EngineRows:
    """The engine's rows as the kind keeps them (--targets topp: cut to mass --top-p; others as they come)."""
    return target_kind(cfg.targets).adapt(cfg, rows)


def _sampler(cfg: CacheBuildConfig, teacher, build_hash: str, j: int):
    """--targets sampled: shard j's own seeded generator (a redone shard draws exactly what it drew before)."""
    if not target_kind(cfg.targets).draws:
        return None
    device = getattr(getattr(teacher, "model", None), "device", torch.device("cpu"))
    return Sampler(
        torch.Generator(device=device).manual_seed(sampling_seed(build_hash, j)),
        cfg.samples,
        cfg.head,
    )


def _sequences(teacher, cfg: CacheBuildConfig):
    """The packed sequences of the build's data."""
    docs = iter_documents(
        cfg.data,
        teacher.tokenizer,
        cfg.text_field,
        vocab=teacher.vocab,
        messages_field=cfg.messages_field,
        train_on=cfg.train_on,
        # the text and each token's characters (format version 6): what a student of another tokenizer aligns by
        with_text=text_tokens_supported(teacher.tokenizer),
    )
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
        counted += sum(
            len(s.tokens) if s.row_mask is None else int(s.row_mask.sum()) for s in group
        )
    if not content:
        raise ValueError(
            f"data: expected some text, got no tokens in {cfg.data} (empty files, or JSONL lines with "
            "empty text); check the inputs"
        )
    if masked and not counted:
        seen = chat_roles(cfg.data, cfg.messages_field)
        roles = ", ".join(f"{r!r} x{n}" for r, n in seen.most_common(8))
        why = (
            "the chat template renders none of their text"
            if "assistant" in seen
            else "rename the replies' role to 'assistant'"
        )
        raise ValueError(
            f"chat data: expected assistant turns to train on (role 'assistant'), got none in "
            f"{cfg.data} (roles seen: {roles}); {why}, or pass --train-on all"
        )
    if masked and rank == 0:
        print(
            f"cache build: chat data: {counted} of the data's tokens are training targets ({cfg.train_on} turns); "
            "the rest is context",
            flush=True,
        )
    return total


def _batched(iterable, n: int):
    it = iter(iterable)
    while group := list(itertools.islice(it, n)):
        yield group


def _build_info(cfg: CacheBuildConfig, teacher: TeacherEngine) -> dict:
    """Everything besides the teacher that decides the cache's bytes: data files and settings."""
    data = [
        {"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": file_sha256(p)}
        for p in cfg.data
    ]
    keep = {
        k: v
        for k, v in asdict(cfg).items()
        if k in ("seq_len", "codec", "seqs_per_shard", "max_sequences", "text_field")
    }
    # chat settings only when changed: plain caches keep their build hash
    defaults = CacheBuildConfig()
    keep.update(
        {
            k: getattr(cfg, k)
            for k in ("messages_field", "train_on")
            if getattr(cfg, k) != getattr(defaults, k)
        }
    )
    targets = target_kind(cfg.targets).settings(cfg)
    if targets is not None:  # None: top-K, whose caches keep the build hash they always had
        keep["targets"] = targets
    if cfg.chat_template:
        keep["chat_template_sha256"] = file_sha256(cfg.chat_template)
    return {**keep, "data": data, "separator": teacher.tokenizer.eos_token_id}
