"""`topkd eval`: score one model (teacher or student) on held-out text, a teacher cache, and multiple choice.

    topkd eval --model runs/student/final --text held_out.txt --cache runs/heldout-cache \
        --choices mmlu.jsonl --limit 500

Prints a table, writes --out (JSON), and prints the same JSON as the last line. Every part is
optional but at least one is needed: --text (perplexity, bits/byte), --cache (KL to the
teacher, top-1 agreement, top-K masses), --choices FILES (accuracy), --lm-eval TASKS
(the real lm-evaluation-harness on the model, for users who have its data sets). --text always reports the
calibration of the model's top-1 (ECE; --reliability PNG draws it); --teacher DIR adds, on the same text, the
full-vocabulary KL(teacher || model), TVD and speculative acceptance that a top-K cache cannot show.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field

from topkd.base.checks import (
    require_device,
    require_dtype,
    require_ints,
    require_path,
    require_writable,
)
from topkd.base.progress import wrote
from topkd.cache import TopKCache
from topkd.cache.building.compat import tokenizer_mismatch
from topkd.data.prompts import chat_prompts, end_of_turn_ids
from topkd.eval.choice import evaluate_choices, load_choice_file
from topkd.eval.completions import evaluate_completions
from topkd.eval.tail import reliability_plot
from topkd.eval.text import evaluate_text
from topkd.eval.vs_cache import evaluate_vs_cache
from topkd.models import load_causal_lm
from topkd.models.generate import GenerationSettings


@dataclass
class EvalConfig:
    model: str = ""
    text: list[str] = field(default_factory=list)
    cache: str = ""
    choices: list[str] = field(default_factory=list)
    limit: int = 0
    seq_len: int = 1024
    max_tokens: int = 0
    max_sequences: int = 0
    lm_eval: list[str] = field(default_factory=list)
    lm_eval_include: str = ""
    fold_beyond_vocab: bool = False
    teacher: str = ""
    prompts: list[str] = field(default_factory=list)
    max_new_tokens: int = 64
    max_prompts: int = 0
    reliability: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    out: str = ""
    name: str = ""


EVAL_HELP = {
    "model": "model to score: a local HF directory or a .gguf file",
    "text": "held-out text files (.txt, .jsonl): perplexity and bits per byte",
    "cache": "a top-K cache of the teacher on held-out text: KL to the teacher, top-1 agreement, top-K masses",
    "choices": "multiple-choice JSONL files (MMLU, ARC, HellaSwag, BoolQ or generic rows): accuracy",
    "limit": "score a seeded random subset of this many questions per choice file (0: all)",
    "seq_len": "tokens per sequence for --text",
    "max_tokens": "score only the first this many tokens of --text (0: all)",
    "max_sequences": "score only this many cache sequences (0: all)",
    "lm_eval": "comma-separated lm-eval task names run through lm-evaluation-harness (optional extra)",
    "lm_eval_include": "a directory of your own lm-eval task YAMLs (e.g. tasks on local JSONL files) for --lm-eval",
    "fold_beyond_vocab": "--cache: score a head smaller than the cache's ids (a student trained with "
    "--fold-beyond-vocab) with those ids in the tail, as it was trained",
    "teacher": "--text: the teacher as well (a local HF directory or .gguf, same tokenizer): full-vocabulary "
    "KL(teacher || model), TVD and speculative acceptance per scored token, which no top-K cache shows",
    "prompts": "with --teacher: chat JSONL whose conversations the model completes (each assistant turn), greedy "
    "and sampled; the teacher's full-vocabulary reverse KL per token on those completions (what on-policy "
    "distillation optimises) and their mean length",
    "max_new_tokens": "--prompts: tokens the model may write per turn",
    "max_prompts": "--prompts: only the first this many prompts (0: all)",
    "reliability": "--text: write the reliability diagram of the model's top-1 (calibration, ECE) as a PNG here",
    "dtype": "model weights dtype: float32 | bfloat16 | float16",
    "device": "cpu | cuda",
    "out": "JSON file for the results (default: none; the last printed line is the same JSON)",
    "name": "label for this model in the table and JSON (default: the model path)",
}


def check_config(cfg: EvalConfig) -> None:
    """Every flag, before the model is loaded: something to evaluate, paths that exist, ranges, the device."""
    if not cfg.model:
        raise ValueError("expected --model (a local HF directory or .gguf file), got none")
    if not (cfg.text or cfg.cache or cfg.choices or cfg.lm_eval or cfg.prompts):
        raise ValueError(
            "expected something to evaluate: --text, --cache, --choices, --prompts or --lm-eval"
        )
    require_path("--model", cfg.model)
    for path in cfg.text + cfg.choices + cfg.prompts:
        require_path("--text/--choices/--prompts", path, "file")
    if cfg.cache:
        require_path("--cache", cfg.cache, "dir")
    if (cfg.teacher and not (cfg.text or cfg.prompts)) or (cfg.reliability and not cfg.text):
        raise ValueError(
            f"--teacher and --reliability go with --text (held-out text both models read; --teacher also "
            f"with --prompts), got teacher={cfg.teacher!r} reliability={cfg.reliability!r} and no --text; add "
            "--text FILES"
        )
    if cfg.prompts and not cfg.teacher:
        raise ValueError(
            "--prompts: expected --teacher, which scores the model's completions, got none; add --teacher DIR"
        )
    if cfg.teacher:
        require_path("--teacher", cfg.teacher)
    for flag, path in (("--out", cfg.out), ("--reliability", cfg.reliability)):
        if path:
            require_writable(flag, path)
    require_ints(cfg, ("seq_len",), 2)
    require_ints(cfg, ("limit", "max_tokens", "max_sequences", "max_prompts"), 0)
    require_ints(cfg, ("max_new_tokens",), 1)
    require_dtype(cfg.dtype)
    require_device(cfg.device)


def run_eval(cfg: EvalConfig) -> dict:
    check_config(cfg)
    if cfg.cache:
        TopKCache(cfg.cache)  # a refused cache is refused before the model loads
    model, tokenizer = load_causal_lm(cfg.model, cfg.dtype, cfg.device, role="model")
    result = {"model": cfg.name or cfg.model}
    if cfg.text:
        result["text"] = _score_text(cfg, model, tokenizer)
    if cfg.prompts:
        for name, scores in _score_completions(cfg, model, tokenizer).items():
            result[f"completions:{name}"] = scores
    if cfg.cache:
        cache = TopKCache(cfg.cache)
        rows = model.get_output_embeddings().weight.shape[0]
        cache.check_student(
            max(rows, cache.vocab_size) if cfg.fold_beyond_vocab else rows, tokenizer
        )
        result["vs_teacher"] = evaluate_vs_cache(
            model, cache, cfg.max_sequences, cfg.fold_beyond_vocab
        )
    for path in cfg.choices:
        name = os.path.splitext(os.path.basename(path))[0]
        result[f"choices:{name}"] = _score_choices(cfg, model, tokenizer, path)
    if cfg.lm_eval:
        result["lm_eval"] = run_lm_eval(cfg)
    print(table([result]))
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        with open(cfg.out, "w") as f:
            json.dump({"config": asdict(cfg), "result": result}, f, indent=1)
    print(json.dumps(result))
    if cfg.out:
        wrote("eval", cfg.out)
    return result


def _score_text(cfg: EvalConfig, model, tokenizer) -> dict:
    """--text: bits/byte and calibration (with --teacher, the full-vocabulary KL too); --reliability: its plot."""
    teacher = load_teacher_for(cfg, tokenizer) if cfg.teacher else None
    scores = evaluate_text(model, tokenizer, cfg.text, cfg.seq_len, cfg.max_tokens, teacher=teacher)
    if cfg.reliability:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.reliability)), exist_ok=True)
        name = cfg.name or os.path.basename(os.path.normpath(cfg.model))
        reliability_plot(
            {"ece": scores["ece"], "bins": scores["calibration"]}, cfg.reliability, name
        )
        wrote("eval", f"the reliability diagram to {cfg.reliability}")
    return scores


def _score_completions(cfg: EvalConfig, model, tokenizer) -> dict:
    """--prompts: the model's greedy and sampled completions, scored by the teacher (topkd/eval/completions.py)."""
    teacher = load_teacher_for(cfg, tokenizer)
    prompts = chat_prompts(cfg.prompts, tokenizer, cfg.seq_len - cfg.max_new_tokens)
    prompts = prompts[: cfg.max_prompts or None]
    stop = end_of_turn_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    scores = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        settings = GenerationSettings(cfg.max_new_tokens, temperature)
        scores[name] = evaluate_completions(model, teacher, prompts, settings, stop, pad)
        for example in scores[name]["examples"]:  # as text, for the report
            example["prompt"] = tokenizer.decode(example["prompt"])[-200:]
            example["completion"] = tokenizer.decode(example["completion"])
    return scores


def _score_choices(cfg: EvalConfig, model, tokenizer, path: str) -> dict:
    """One multiple-choice file (--limit: a seeded sample of its items)."""
    items, skipped = load_choice_file(path)
    if cfg.limit and cfg.limit < len(items):
        items = random.Random(0).sample(items, cfg.limit)
    return {**evaluate_choices(model, tokenizer, items), "skipped_rows": skipped}


def load_teacher_for(cfg: EvalConfig, tokenizer):
    """The live teacher, refused unless it tokenises as the model does (one vocabulary for both distributions)."""
    teacher, teacher_tokenizer = load_causal_lm(cfg.teacher, cfg.dtype, cfg.device, role="teacher")
    problem = tokenizer_mismatch(teacher_tokenizer, tokenizer)
    if problem:
        raise ValueError(
            f"--teacher: expected the model's tokenizer, got different token ids ({problem}); "
            "compare a student with its own teacher"
        )
    return teacher


def run_lm_eval(cfg: EvalConfig) -> dict:
    if not os.path.isdir(cfg.model):
        raise ValueError(
            f"--lm-eval: expected a Hugging Face model directory, got {cfg.model!r}; save a GGUF "
            "model with save_pretrained first (topkd demo does this for its teacher)"
        )
    if cfg.lm_eval_include and not os.path.isdir(cfg.lm_eval_include):
        raise ValueError(
            f"--lm-eval-include: expected a directory of lm-eval task YAMLs, got {cfg.lm_eval_include!r}"
        )
    # topkd never downloads: no minutes of hub retries
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    try:
        import lm_eval
    except ImportError as e:
        raise ValueError(
            "--lm-eval: expected lm-evaluation-harness, got no lm_eval module; install the extra: "
            "pip install 'topkd[eval]'"
        ) from e
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=cfg.lm_eval_include or None)
    try:
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={cfg.model},dtype={cfg.dtype}",
            tasks=cfg.lm_eval,
            device=cfg.device,
            limit=cfg.limit or None,
            task_manager=tasks,
        )
    except Exception as e:  # noqa: BLE001 - the harness raises whatever its data loaders raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(
            f"--lm-eval {','.join(cfg.lm_eval)}: the harness could not run it offline "
            f"({type(e).__name__}: {first}); topkd never downloads: give the task's data as local "
            "files with a task YAML in --lm-eval-include DIR (README, Evaluation)"
        ) from None
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for task, metrics in out["results"].items()
    }


ROWS = [
    ("text", "bits_per_byte", "bits/byte"),
    ("text", "perplexity", "ppl"),
    ("text", "ece", "ECE"),
    ("text", "kl_full", "KL full vocab"),
    ("text", "acceptance", "acceptance"),
    ("vs_teacher", "kl_bucket", "KL bucket"),
    ("vs_teacher", "kl_renorm", "KL renorm"),
    ("vs_teacher", "top1_agreement", "top-1 agree"),
    ("vs_teacher", "student_mass_on_topk", "mass on top-K"),
    ("vs_teacher", "acceptance_upper_bound", "accept <= (cache)"),
    ("completions:greedy", "reverse_kl", "rKL own greedy"),
    ("completions:greedy", "completion_len", "len own greedy"),
    ("completions:sampled", "reverse_kl", "rKL own sampled"),
    ("completions:sampled", "completion_len", "len own sampled"),
]


def table(results: list[dict]) -> str:
    """One column per model; rows for every measure any of them has."""
    names = [r["model"][-24:] for r in results]
    keys = [(s, k, label) for s, k, label in ROWS if any(k in r.get(s, {}) for r in results)]
    keys += [
        (s, "acc", s.split(":", 1)[1] + " acc")
        for s in dict.fromkeys(s for r in results for s in r if s.startswith("choices:"))
    ]
    keys += [
        (f"lm_eval:{task}", metric, f"{task} {metric.split(',')[0]}")
        for task, metric in dict.fromkeys(
            (t, m)
            for r in results
            for t, ms in r.get("lm_eval", {}).items()
            for m in ms
            if "stderr" not in m
        )
    ]
    lines = [f"{'':<16}" + "".join(f"{n:>26}" for n in names)]
    for section, key, label in keys:
        cells = [_cell(r, section, key) for r in results]
        lines.append(
            f"{label:<16}" + "".join(f"{'-' if c is None else f'{c:.4f}':>26}" for c in cells)
        )
    return "\n".join(lines)


def _cell(result: dict, section: str, key: str) -> float | None:
    if section.startswith("lm_eval:"):
        return result.get("lm_eval", {}).get(section.split(":", 1)[1], {}).get(key)
    return result.get(section, {}).get(key)
