"""benchmarks/cross_tokenizer.py's report on hand-made records: means, seed spread, differences paired with ce.

python -m pytest tests/benchmarks/test_cross_tokenizer.py
"""

import argparse
import json

import pytest

from benchmarks.cross_tokenizer import report


def test_the_report_pairs_every_arm_with_ce_seed_by_seed(tmp_path):
    args = argparse.Namespace(
        out=str(tmp_path),
        steps=4,
        seq_len=16,
        sequences=8,
        heldout_tokens=64,
        vocab=300,
        seeds="0,1",
    )
    scores = {"ce": [3.0, 3.2], "align + ce": [2.9, 3.0], "uld + ce": [3.1]}
    records = {
        (arm, seed): {"score": {"bits_per_byte": v}}
        for arm, values in scores.items()
        for seed, v in enumerate(values)
    }
    text = report(args, records, teacher_bpb=1.5)
    result = json.load(open(tmp_path / "cross.json"))
    arms = result["arms"]
    assert arms["align + ce"]["paired_vs_ce"] == pytest.approx(-0.15)
    assert arms["uld + ce"]["paired_vs_ce"] == pytest.approx(
        0.1
    )  # seed 0 only: the seeds both have
    assert arms["ce"]["paired_vs_ce"] is None and arms["ce"]["spread"] == pytest.approx(0.2)
    assert "align + ce" in text and (tmp_path / "cross.png").stat().st_size > 0
    assert result["stamp"]["machine"] and result["teacher_bits_per_byte"] == 1.5
