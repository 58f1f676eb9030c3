"""benchmarks/sparse_report.py on hand-made scores: the gap closed, paired differences and the tokens scaling call.

python -m pytest tests/benchmarks/test_sparse_report.py
"""

import pytest

from benchmarks.sparse_report import paired, scaling, summarise, write

BASE = {"bits_per_byte": 2.0, "ece": 0.02, "acceptance": 0.3, "train_tokens": 1000}


def _runs(kl_by_arm: dict, lm_by_arm: dict, tokens: int = 1000) -> dict:
    return {
        arm: {
            str(s): {**BASE, "lm_loss": lm_by_arm[arm][s], "kl_full": kl, "train_tokens": tokens}
            for s, kl in enumerate(kls)
        }
        for arm, kls in kl_by_arm.items()
    }


LM = {"ce": [5.7, 5.7], "sampled N=50": [5.6, 5.6], "dense online": [5.5, 5.5]}


def test_gap_closed_and_paired_differences():
    runs = _runs({"ce": [2.4, 2.4], "sampled N=50": [2.0, 1.9], "dense online": [1.9, 1.9]}, LM)
    arms = summarise(runs, {"ce": {"bytes_per_token": 220.0, "build_s": 1.0}})
    assert arms["sampled N=50"]["gap_closed"] == pytest.approx(0.5)
    assert arms["ce"]["gap_closed"] == pytest.approx(0.0)
    assert arms["sampled N=50"]["kl_gap_closed"] == pytest.approx(0.9)  # (2.4 - 1.95) / (2.4 - 1.9)
    assert arms["dense online"]["bytes_per_token"] is None
    assert paired(runs, "sampled N=50", "kl_full") == pytest.approx({"0": 0.1, "1": 0.0})


def test_an_arm_missing_a_seed_is_compared_on_the_seeds_both_have():
    from benchmarks.sparse_report import _versus

    runs = _runs({"sampled N=50": [2.0], "dense online": [1.9, 1.5]}, LM)
    assert "kl_full +0.1000 (per seed +0.1000;" in _versus(runs, "sampled N=50", "kl_full")


def test_no_gap_to_close_where_ce_is_no_worse_than_dense_kd():
    lm = {
        "ce": [5.4, 5.4],
        "sampled N=50": [5.6, 5.6],
        "dense online": [5.5, 5.5],
    }  # CE wins in LM loss
    runs = _runs({"ce": [2.4, 2.4], "sampled N=50": [2.0, 2.0], "dense online": [1.9, 1.9]}, lm)
    arms = summarise(runs, {})
    assert arms["sampled N=50"]["gap_closed"] is None
    assert arms["sampled N=50"]["kl_gap_closed"] == pytest.approx(0.8)


def test_scaling_says_shrank_only_beyond_the_spread(tmp_path):
    before = _runs({"sampled N=50": [2.0, 2.01], "dense online": [1.9, 1.9]}, LM)
    shrank = _runs({"sampled N=50": [1.91, 1.91], "dense online": [1.9, 1.9]}, LM, tokens=4000)
    same = _runs({"sampled N=50": [1.995, 2.0], "dense online": [1.9, 1.9]}, LM, tokens=4000)
    text = scaling({"runs": shrank}, {"runs": before, "source": "b"})
    assert "1,000 -> 4,000" in text and "shrank" in text
    assert "no change beyond" in scaling({"runs": same}, {"runs": before})
    args = {"steps": 4, "seq_len": 8, "seeds": "0,1", "heldout_tokens": 16, "chat": 0}
    result = {"args": args, "stamp": {"commit": "x"}, "runs": shrank, "arms": summarise(shrank, {})}
    report = write(result, str(tmp_path), {"runs": before, "source": "b"})
    assert "shrank" in report and (tmp_path / "sparse.png").stat().st_size > 0
