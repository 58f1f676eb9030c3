"""The metrics that see the tail: ECE against a hand computation, full-vocabulary KL and TVD against a float64
brute force (acceptance = sum min(p, q) = 1 - TVD), and `topkd eval --teacher --reliability` end to end."""

import os

import numpy as np
import pytest
import torch

from topkd.eval.heads import paired_divergences
from topkd.eval.tail import calibration


def test_ece_is_the_hand_computation():
    confidence = [0.05, 0.15, 0.95, 0.95, 1.0]
    correct = [False, True, True, False, True]
    calib = calibration(np.array(confidence), np.array(correct), bins=10)
    # bin [0, .1): conf .05, acc 0; bin [.1, .2): conf .15, acc 1; bin [.9, 1]: conf .9667, acc 2/3
    assert calib["ece"] == pytest.approx(
        0.05 / 5 + 0.85 / 5 + abs(2 / 3 - (0.95 + 0.95 + 1.0) / 3) * 3 / 5
    )
    assert [b["count"] for b in calib["bins"]] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 3]
    with pytest.raises(ValueError, match="expected two equal non-empty 1-D arrays"):
        calibration(np.zeros(3), np.zeros(2, bool))


# 3-row chunks too
@pytest.mark.parametrize("n, v, chunk_bytes", [(7, 11, 1 << 20), (37, 50, 4 * 50 * 2 * 3)])
def test_full_vocabulary_kl_tvd_and_acceptance_against_float64(n, v, chunk_bytes):
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(n, 8, generator=g), torch.randn(n, 6, generator=g)
    ws, wt, bt = (
        torch.randn(v, 8, generator=g),
        3 * torch.randn(v, 6, generator=g),
        torch.randn(v, generator=g),
    )
    got = paired_divergences(hs, (ws, None, None), ht, (wt, bt, None), chunk_bytes=chunk_bytes)
    logq = torch.log_softmax(hs.double() @ ws.double().T, -1)
    logp = torch.log_softmax(ht.double() @ wt.double().T + bt.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    accept = torch.minimum(logp.exp(), logq.exp()).sum(-1)  # speculative acceptance, by brute force
    assert torch.allclose(got["kl"].double(), kl, atol=1e-5, rtol=1e-4)
    assert torch.allclose(1 - got["tvd"].double(), accept, atol=1e-5)
    same = paired_divergences(ht, (wt, bt, None), ht, (wt, bt, None))
    assert float(same["kl"].max()) < 1e-6 and float(same["tvd"].max()) < 1e-6


def test_eval_with_a_live_teacher_sees_the_whole_distribution(
    built_cache, teacher_dir, text_file, tmp_path, capsys
):
    from tests.train.runs import config
    from topkd.eval.run import EvalConfig, run_eval
    from topkd.train import train

    train(config(built_cache, tmp_path / "run", steps=2))
    student = str(tmp_path / "run" / "final")
    itself = run_eval(
        EvalConfig(model=teacher_dir, text=[text_file], teacher=teacher_dir, max_tokens=300)
    )["text"]
    assert itself["kl_full"] < 1e-5 and itself["acceptance"] > 1 - 1e-5 and 0 <= itself["ece"] <= 1
    got = run_eval(
        EvalConfig(
            model=student,
            text=[text_file],
            teacher=teacher_dir,
            max_tokens=300,
            reliability=str(
                tmp_path / "plots" / "new" / "rel.png"
            ),  # its folders made, not an errno
        )
    )["text"]
    assert (
        got["kl_full"] > 0.01
        and 0 < got["acceptance"] < 1
        and sum(b["count"] for b in got["calibration"]) == got["scored_tokens"]
    )
    assert (
        tmp_path / "plots" / "new" / "rel.png"
    ).stat().st_size > 5000 and "reliability diagram" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--teacher and --reliability go with --text"):
        run_eval(EvalConfig(model=student, cache=built_cache, teacher=teacher_dir))


@pytest.mark.parametrize("flag", ["reliability", "out"])
def test_an_output_it_could_not_write_is_refused_before_the_evaluation(
    teacher_dir, text_file, tmp_path, flag
):
    from topkd.eval.run import EvalConfig, run_eval

    (tmp_path / "a-file").write_text("not a folder")
    for path, match in [
        (
            tmp_path / "a-file" / "sub" / "x",
            rf"--{flag}: expected a path this user can write, .* a file it cannot",
        ),
        (tmp_path, rf"--{flag}: expected a file to write, got .*, a directory"),
    ]:
        cfg = EvalConfig(
            model=str(tmp_path / "no-model-loads"), text=[text_file], **{flag: str(path)}
        )
        os.makedirs(cfg.model)  # exists, yet holds no model: a load would fail with another error
        with pytest.raises(ValueError, match=match):
            run_eval(cfg)
        os.rmdir(cfg.model)


def test_a_teacher_of_another_tokenizer_is_refused(teacher_dir, text_file, tmp_path):
    import json
    import shutil

    from topkd.eval.run import EvalConfig, run_eval

    other = shutil.copytree(teacher_dir, tmp_path / "other")  # the same size, two ids swapped
    tok = json.load(open(other / "tokenizer.json"))
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    json.dump(tok, open(other / "tokenizer.json", "w"))
    with pytest.raises(
        ValueError, match="--teacher: expected the model's tokenizer, got different token ids"
    ):
        run_eval(
            EvalConfig(model=teacher_dir, text=[text_file], teacher=str(other), max_tokens=100)
        )


def test_the_cache_acceptance_bound_is_an_upper_bound_of_the_true_one():
    """From a cache, acceptance is only bounded: the tail is one bucket (min of sums >= sum of mins)."""
    from topkd.eval.vs_cache import acceptance_bound

    g = torch.Generator().manual_seed(0)
    for k in (1, 3, 20):
        logp = torch.log_softmax(3 * torch.randn(50, 20, generator=g, dtype=torch.float64), -1)
        logq = torch.log_softmax(torch.randn(50, 20, generator=g, dtype=torch.float64), -1)
        true = torch.minimum(logp.exp(), logq.exp()).sum(-1)
        ids = logp.argsort(-1, descending=True)[:, :k]  # the teacher's top-k, as a cache keeps it
        bound = acceptance_bound(logp.gather(1, ids), logq.gather(1, ids))
        assert (bound >= true - 1e-12).all() and (bound <= 1 + 1e-12).all()
        if k == 20:  # the whole vocabulary cached: exact
            assert torch.allclose(bound, true)
