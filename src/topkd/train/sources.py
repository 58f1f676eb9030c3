"""Where `topkd train`'s teacher rows come from, and what the run may ask of them.

    source = open_source(cfg, device)      # the cache (offline) or the teacher run in memory (online)
    scorer = open_scorer(cfg, device, source)   # --on-policy: the teacher that scores the student's turns
    check_source(cfg, source)              # --top-k, sampled targets and counted rows, before a student loads

Both kinds are a topkd.data.samples.SequenceSource.
"""

from __future__ import annotations

from topkd.cache import TopKCache
from topkd.cache.building.served import ServedTeacher
from topkd.cache.building.teacher import TeacherEngine, load_teacher, tokenizer_hash
from topkd.data.samples import SequenceSource
from topkd.models import load_tokenizer
from topkd.train.config import TrainConfig, loss_options, teacher_of
from topkd.train.cross import CrossTokenizerSource
from topkd.train.online import OnlineTeacher


def open_source(cfg: TrainConfig, device: str) -> TopKCache | OnlineTeacher:
    """Where teacher rows come from: the cache (offline) or the teacher run in memory (online)."""
    if cfg.cache and cfg.cross_tokenizer:
        tokenizer = load_tokenizer(cfg.student, "student")
        return CrossTokenizerSource(TopKCache(cfg.cache), tokenizer, cfg.cross_tokenizer)
    if cfg.cache:
        return TopKCache(cfg.cache)
    return _online_teacher(cfg, device, cfg.seq_len)


def open_scorer(cfg: TrainConfig, device: str, source: SequenceSource, world: int) -> OnlineTeacher:
    """--on-policy's teacher, which scores the student's completions: the online source itself, or (--cache
    beside --teacher) the teacher loaded apart, refused unless it gives the cache's ids (its tokenizer and
    vocabulary), since its rows and the cache's train one student side by side."""
    if (
        world > 1
    ):  # FSDP2's collectives need every rank to run as many forwards: generations differ in length
        raise ValueError(
            f"--on-policy: expected one process, got {world} under torchrun; run it as one process "
            "(one GPU) for now"
        )
    if isinstance(source, OnlineTeacher):
        return source
    scorer = _online_teacher(cfg, device, cfg.seq_len or source.seq_len)
    ours, cached = tokenizer_hash(scorer.teacher.tokenizer), source.fingerprint["tokenizer_sha256"]
    if ours != cached or scorer.vocab_size != source.vocab_size:
        raise ValueError(
            f"teacher {teacher_of(cfg)}: expected the tokenizer and vocabulary of the teacher that built --cache "
            f"{cfg.cache} (sha256 {cached[:12]}, {source.vocab_size} ids), got sha256 {ours[:12]} and "
            f"{scorer.vocab_size} ids; pass that teacher (or a cache built from this one)"
        )
    return scorer


def _online_teacher(cfg: TrainConfig, device: str, seq_len: int) -> OnlineTeacher:
    temperatures = [cfg.temperature] if loss_options(cfg).needs_logz else []
    return OnlineTeacher(
        _teacher_engine(cfg, device, temperatures),
        cfg.data,
        seq_len,
        cfg.online_k,
        temperatures,
        cfg.text_field,
        cfg.max_sequences,
        cfg.messages_field,
        cfg.train_on,
        cfg.online_samples,
    )


def _teacher_engine(cfg: TrainConfig, device: str, temperatures: list[float]) -> TeacherEngine:
    """The teacher in memory (--teacher), or served (--teacher-url: the student's tokenizer, probed against the
    server's before anything trains)."""
    if not cfg.teacher_url:
        return load_teacher(cfg.teacher, device=device)
    if temperatures:
        raise ValueError(
            f"--teacher-url: expected a loss a server's top-K can give (it returns no c_T), got tempered "
            f"bucket KD (--temperature {cfg.temperature}); pass --tail renorm, or --temperature 1"
        )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(cfg.student).get_text_config().vocab_size
    tokenizer = load_tokenizer(cfg.student, "student")
    return ServedTeacher(cfg.teacher_url, tokenizer, vocab, cfg.online_k, cfg.teacher_timeout)


def check_top_k(top_k: int, source: SequenceSource) -> None:
    """--top-k takes the first N columns, which are the teacher's N most likely tokens only in rank-ordered rows."""
    if top_k and not source.k:
        raise ValueError(
            f"top_k={top_k}: expected rank-ordered teacher rows (a cache, or --online-k), got "
            "full-vocabulary online rows; use --online-k instead"
        )
    if top_k > source.k:
        raise ValueError(
            f"top_k: expected at most the teacher rows' K={source.k}, got {top_k}; build the cache "
            "with a larger --k"
        )


def check_source(cfg: TrainConfig, source: SequenceSource) -> None:
    """What the run's flags ask of these rows: --top-k within their K, a loss sampled targets can train, and some
    rows that count for the loss."""
    check_top_k(cfg.top_k, source)
    check_targets(cfg, source)
    if source.counted_tokens == 0:
        raise ValueError(
            f"cache {cfg.cache}: expected rows that count for the loss, got 0 of its {source.tokens} "
            "tokens (chat data without assistant turns); rebuild it with --train-on all, or from "
            "conversations whose replies have role 'assistant'"
        )


def check_targets(cfg: TrainConfig, source: SequenceSource) -> None:
    """What the source's kind of target can train with (topkd/cache/format/targets.py): sampled rows (count / N of N
    draws, no tail) only a forward divergence at T = 1."""
    problem = source.target_kind.training_problem(cfg.divergence, cfg.temperature, cfg.top_k)
    if problem:
        where = f"cache {cfg.cache}" if isinstance(source, TopKCache) else "--online-samples"
        raise ValueError(
            f"{where}: {problem}; pass --divergence kl (or jsd, tvd), --temperature 1 and no "
            "--top-k, or train on top-K rows"
        )
