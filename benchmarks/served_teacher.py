"""A served teacher against the same teacher in memory: does `--teacher-url` train on the teacher's own rows?

    python -m benchmarks.served_teacher --url http://localhost:8000/v1 --teacher TEACHER --chats chats.jsonl \
        --k 20 --out benchmarks/results/served-teacher-cpu/vllm.json

Renders --conversations chats of the file with the teacher's chat template, scores them through the server
(topkd/cache/building/served.py: its probe, its dialect) and in memory (Teacher.sequence_rows, fp32), and writes
per dialect: the share of rows the server scored, of top-K ids equal (in rank order), of top-1 ids equal, the
largest and median |log-prob| difference over equal ids, the median |log tail| difference (a server's tail is
1 - kept mass, not summed: imprecise where the top-K holds nearly everything), and seconds per scored token.
A server that quantises the teacher (llama.cpp on a GGUF) differs by its kernels, not by topkd.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import numpy as np

from topkd.bench import Sequence, ServedTeacher, load_teacher, stamp, write_json_atomic


def chat_sequences(tokenizer, path: str, n: int) -> list[Sequence]:
    with open(path) as f:
        talks = [json.loads(line)["messages"] for line in f if line.strip()][:n]
    out = []
    for i, messages in enumerate(talks):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        out.append(Sequence(np.asarray(ids, np.int64), np.zeros(1, np.int64), i, 0))
    return out


def agreement(served: list, memory: list) -> dict:
    """How close the server's rows are to the teacher's in memory, over the rows it scored."""
    rows = [(g, w, g.scored) for g, w in zip(served, memory)]
    ids = np.concatenate([g.ids[m] == w.ids[m] for g, w, m in rows])
    same = [np.abs(g.logprobs[m] - w.logprobs[m])[g.ids[m] == w.ids[m]] for g, w, m in rows]
    gaps = np.concatenate([s[np.isfinite(s)] for s in same])
    tails = np.concatenate([np.abs(g.log_tail[m] - w.log_tail[m]) for g, w, m in rows])
    return {
        "rows": int(sum(len(g) for g, _, _ in rows)),
        "scored_share": float(np.mean(np.concatenate([m for _, _, m in rows]))),
        "topk_ids_equal": float(ids.mean()),
        "top1_equal": float(
            np.mean(np.concatenate([g.ids[m, 0] == w.ids[m, 0] for g, w, m in rows]))
        ),
        "logprob_gap_max": float(gaps.max()),
        "logprob_gap_median": float(np.median(gaps)),
        "log_tail_gap_median": float(np.median(tails)),
    }


def server_version(root: str) -> str | None:
    try:
        with urllib.request.urlopen(root + "/version", timeout=10) as r:
            return json.loads(r.read()).get("version")
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True)
    parser.add_argument(
        "--teacher", required=True, help="the same teacher, in memory (HF dir or .gguf)"
    )
    parser.add_argument("--chats", required=True, help="chat JSONL (a 'messages' list per line)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    teacher = load_teacher(args.teacher)
    client = ServedTeacher(args.url, teacher.tokenizer, teacher.vocab, args.k)
    seqs = chat_sequences(teacher.tokenizer, args.chats, args.conversations)
    start = time.perf_counter()
    served = client.sequence_rows(seqs)
    seconds = time.perf_counter() - start
    memory = teacher.sequence_rows(seqs, args.k, (), 1)
    tokens = sum(len(s.tokens) for s in seqs)
    result = {
        "bench": "served-teacher",
        "stamp": stamp("cpu"),
        "server": {
            "url": args.url,
            "dialect": client.api,
            "model": client.model,
            "version": server_version(client.root),
        },
        "args": {
            "teacher": os.path.basename(os.path.normpath(args.teacher)),
            "k": args.k,
            "conversations": len(seqs),
        },
        "tokens": tokens,
        "unaligned": client.unaligned,
        "seconds_per_token": seconds / tokens,
        **agreement(served, memory),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "stamp"}, indent=1))


if __name__ == "__main__":
    main()
