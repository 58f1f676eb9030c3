"""The teacher's reverse KL on a model's own completions: zero for the teacher itself, the float64 brute force of
KL(q || p) at each written token by hand, and `topkd eval --prompts` end to end (greedy and sampled)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from topkd.eval.completions import completion_reverse_kl, evaluate_completions
from topkd.models.generate import GenerationSettings


@pytest.fixture(scope="module")
def pair(chat_teacher_dir):
    teacher = AutoModelForCausalLM.from_pretrained(chat_teacher_dir).eval()
    torch.manual_seed(1)
    student = AutoModelForCausalLM.from_pretrained(chat_teacher_dir).eval()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return teacher, student


def test_reverse_kl_per_written_token_is_the_brute_force(pair):
    teacher, student = pair
    prompt, completion = np.array([5, 6, 7, 8]), np.array([9, 10, 11])
    got = completion_reverse_kl(student, teacher, prompt, completion)
    tokens = torch.from_numpy(np.concatenate([prompt, completion]))[None]
    with torch.no_grad():  # whole logits, float64, rows 3..5 predict tokens 4..6 (the completion)
        q = torch.log_softmax(student(tokens).logits[0, 3:6].double(), -1)
        p = torch.log_softmax(teacher(tokens).logits[0, 3:6].double(), -1)
    want = (q.exp() * (q - p)).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert (want > 0).all()
    assert completion_reverse_kl(teacher, teacher, prompt, completion).abs().max() < 1e-9


def test_scores_weigh_each_written_token_once(pair):
    teacher, student = pair
    prompts = [np.array([5, 6, 7]), np.array([8, 9, 10, 11, 12])]
    settings = GenerationSettings(6, temperature=1.0)
    got = evaluate_completions(
        student, teacher, prompts, settings, [999_999], 0, seed=3, batch_size=1
    )
    assert got["tokens"] == 12 and got["completion_len"] == 6 and got["prompts"] == 2
    assert got["reverse_kl"] > 0 and len(got["examples"]) == 2
    itself = evaluate_completions(teacher, teacher, prompts, settings, [999_999], 0)
    assert itself["reverse_kl"] == pytest.approx(0, abs=1e-9)


def test_eval_prompts_end_to_end(chat_teacher_dir, chats_file, tmp_path, capsys):
    from topkd.eval.run import EvalConfig, run_eval

    got = run_eval(
        EvalConfig(
            model=chat_teacher_dir,
            teacher=chat_teacher_dir,
            prompts=[chats_file],
            max_new_tokens=8,
            max_prompts=4,
            seq_len=96,
        )
    )
    for name in ("greedy", "sampled"):
        scores = got[f"completions:{name}"]
        assert scores["prompts"] == 4 and scores["reverse_kl"] == pytest.approx(0, abs=1e-9)
        assert isinstance(scores["examples"][0]["completion"], str)
    assert "rKL own greedy" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--prompts: expected --teacher"):
        run_eval(EvalConfig(model=chat_teacher_dir, prompts=[chats_file]))
