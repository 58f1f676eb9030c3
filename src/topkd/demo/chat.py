"""The demo's chat step: a small chat set made from the plays, distilled with assistant-only targets.

Each conversation is one exchange of a play: the user gives a speech (its speaker named) and asks for the
reply; the assistant answers with the next speech. Conversations are rendered with the teacher's chat
template, and only the assistant turns (reply and end-of-turn token) count for KD and CE; the teacher still
reads the whole conversation. The same untrained student is trained with KD and, as the baseline, with
cross entropy on the same assistant tokens, then both (and the teacher and the untrained student) are
scored against a held-out chat cache of Hamlet: KL to the teacher on the assistant tokens.
"""

from __future__ import annotations

import json
import os
import random
import re

from topkd.base.files import write_atomic
from topkd.cache import CacheBuildConfig, TopKCache, build
from topkd.cache.format import TARGET_KINDS
from topkd.eval.run import EvalConfig, run_eval
from topkd.train import TrainConfig, train

__all__ = [
    "STUDENTS",
    "cache_step",
    "chat_lines",
    "models_to_score",
    "play_conversations",
    "run_chat_step",
    "train_students",
    "write_conversations",
]

# "Ham." / "Mar. and Ber."
SPEAKER = re.compile(r"^([A-Z][A-Za-z]*\.?( and [A-Z][A-Za-z]*\.?)?)\s*$")


def speeches(path: str) -> list[tuple[str, str]]:
    """(speaker, text) of every speech in a Gutenberg play: a block whose first line names the speaker."""
    out = []
    for block in open(path, encoding="utf-8").read().split("\n\n"):
        lines = block.strip().splitlines()
        if len(lines) >= 2 and SPEAKER.match(lines[0].strip()):
            text = " ".join(line.strip() for line in lines[1:] if not line.strip().startswith("["))
            if text:
                out.append((lines[0].strip().rstrip("."), text))
    return out


def play_conversations(paths: list[str], limit: int, seed: int = 0) -> list[list[dict]]:
    """Consecutive speeches by different speakers as (user: cue, assistant: reply), a seeded sample of limit."""
    pairs = []
    for path in paths:
        said = speeches(path)
        pairs += [(a, b) for a, b in zip(said, said[1:]) if a[0] != b[0]]
    random.Random(seed).shuffle(pairs)
    return [
        [
            {"role": "user", "content": f"{a[0]}: {a[1]}\n\nReply as {b[0]}."},
            {"role": "assistant", "content": b[1]},
        ]
        for a, b in pairs[:limit]
    ]


def write_conversations(conversations: list[list[dict]], path: str) -> str:
    if not os.path.exists(path):
        write_atomic(
            path, "".join(json.dumps({"messages": m}) + "\n" for m in conversations).encode()
        )
    return path


def run_chat_step(
    out: str,
    teacher_dir: str,
    init_dir: str,
    train_files: list[str],
    heldout: str,
    n: dict,
    seq_len: int,
    k: int,
    step,
) -> dict | None:
    """Chat caches, KD and CE students, and their scores on held-out assistant tokens (each a resumable step).
    None, said loudly, when the teacher has no chat template."""
    from transformers import AutoTokenizer

    if not AutoTokenizer.from_pretrained(teacher_dir).chat_template:
        print(
            f"== demo: chat step skipped: the teacher {teacher_dir} has no chat template",
            flush=True,
        )
        return None
    chat = os.path.join(out, "chat")
    os.makedirs(chat, exist_ok=True)
    sets = {
        "train": write_conversations(
            play_conversations(train_files, n["chat_train"]), os.path.join(chat, "train.jsonl")
        ),
        "heldout": write_conversations(
            play_conversations([heldout], n["chat_heldout"]), os.path.join(chat, "heldout.jsonl")
        ),
    }
    for name, data in sets.items():
        cache_step(
            step,
            f"chat {name} cache",
            teacher_dir,
            [data],
            os.path.join(chat, f"{name}-cache"),
            seq_len,
            k,
        )
    train_students(step, "chat ", os.path.join(chat, "train-cache"), init_dir, chat, n)
    models = models_to_score(teacher_dir, init_dir, chat)
    scores = {
        name: step(f"chat eval {name}", lambda nm=name, p=path: _score(chat, nm, p))
        for name, path in models.items()
    }
    cache = TopKCache(os.path.join(chat, "train-cache"))
    return {
        "bytes_per_token": cache.manifest["totals"]["bytes_per_token"],
        "tokens": cache.tokens,
        "counted_tokens": cache.counted_tokens,
        "counted_fraction": cache.counted_tokens / cache.tokens,
        "conversations": {name: sum(1 for _ in open(path)) for name, path in sets.items()},
        "models": scores,
    }


STUDENTS = {
    "student-kd": "kd",
    "student-ce": "ce",
}  # the KD student and its CE control, from the same cut


def cache_step(
    step,
    name: str,
    teacher: str,
    data: list[str],
    out: str,
    seq_len: int,
    k: int,
    max_sequences: int = 0,
    **targets,
) -> None:
    """A demo cache, built (or resumed) as one step; targets: e.g. targets="sampled", samples=50 (none: top-K)."""
    targets = {"targets": "topk", **targets}
    if (
        "k" in TARGET_KINDS[targets["targets"]].flags
    ):  # a sampled build refuses a --k it would ignore
        targets["k"] = k
    config = CacheBuildConfig(
        teacher=teacher, data=data, out=out, seq_len=seq_len, max_sequences=max_sequences, **targets
    )
    step(name, lambda: build(config))


def train_students(
    step, prefix: str, cache: str, init_dir: str, out: str, n: dict, students: dict = STUDENTS
) -> None:
    """Students (name: objective) trained on one cache from the same initialisation, one step each: by default
    the KD student and its CE control."""
    for name, objective in students.items():
        config = TrainConfig(
            cache=cache,
            student=init_dir,
            out=os.path.join(out, name),
            objective=objective,
            steps=n["steps"],
            batch_size=n["batch_size"],
            lr=5e-4,
            warmup_steps=n["warmup"],
            checkpoint_every=32,
        )
        step(prefix + name, lambda c=config: train(c))


def models_to_score(
    teacher_dir: str, init_dir: str, out: str, students: tuple[str, ...] = tuple(STUDENTS)
) -> dict[str, str]:
    """Every model the demo scores: the teacher, the cut it starts from, and the students' final weights."""
    finals = {name: os.path.join(out, name, "final") for name in students}
    return {"teacher": teacher_dir, "student-init": init_dir, **finals}


def _score(chat: str, name: str, model: str) -> dict:
    out = os.path.join(chat, "eval", f"{name}.json")
    if os.path.exists(out):
        return json.load(open(out))["result"]["vs_teacher"]
    return run_eval(
        EvalConfig(model=model, name=name, cache=os.path.join(chat, "heldout-cache"), out=out)
    )["vs_teacher"]


def chat_lines(chat: dict) -> list[str]:
    lines = [
        f"chat: {sum(chat['conversations'].values())} conversations from the plays, {chat['tokens']:,} tokens, "
        f"{chat['bytes_per_token']:.1f} bytes/token, {chat['counted_fraction']:.1%} counted (assistant turns)",
        f"{'held-out chat':<16}{'KL bucket':>11}{'KL renorm':>11}{'top-1 agree':>13}   (assistant tokens)",
    ]
    for name, v in chat["models"].items():
        lines.append(
            f"{name:<16}{v['kl_bucket']:>11.4f}{v['kl_renorm']:>11.4f}{v['top1_agreement']:>13.3f}"
        )
    return lines
