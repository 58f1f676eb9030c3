"""`topkd demo --quick` end to end on the tiny teacher (CI); the real SmolLM2 + Shakespeare run is a slow test."""
import json
import os

import pytest

from tests.assets import PLAYS, SMOLLM2, asset
from tests.cache.tiny import make_text
from topkd.demo import DemoConfig, run_demo


def plays(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, name in enumerate(["hamlet_gut.txt", "lear_gut.txt", "macbeth_gut.txt", "lear_gut_f.txt"]):
        (texts / name).write_text(make_text(900, seed=i))
    return str(texts)


def test_quick_demo_runs_every_step_and_reports(teacher_dir, tmp_path, capsys):
    cfg = DemoConfig(out=str(tmp_path / "demo"), quick=True, teacher=teacher_dir, texts=plays(tmp_path), layers=1,
                     seq_len=32, k=16)
    report = run_demo(cfg)
    assert set(report["models"]) == {"teacher", "student-init", "student-kd", "student-ce"}
    kl = {name: m["vs_teacher"]["kl_bucket"] for name, m in report["models"].items()}
    assert kl["teacher"] < 1e-3 < kl["student-init"]
    assert kl["student-kd"] < kl["student-init"]  # distillation moved the student towards the teacher
    for name in ("report.txt", "report.json", "demo.png", "timings.json"):
        assert os.path.getsize(tmp_path / "demo" / name) > 0
    assert "bits/byte" in capsys.readouterr().out
    again = run_demo(cfg)  # every step is done: a rerun only re-reads and re-reports
    assert again["models"] == json.loads(json.dumps(report["models"]))


@pytest.mark.slow
def test_quick_demo_on_smollm2_and_shakespeare(tmp_path):
    report = run_demo(DemoConfig(out=str(tmp_path / "demo"), quick=True, teacher=asset(SMOLLM2), texts=asset(PLAYS)))
    kl = {name: m["vs_teacher"]["kl_bucket"] for name, m in report["models"].items()}
    assert kl["teacher"] < 1e-3 and kl["student-kd"] < kl["student-init"]
    assert report["cache"]["bytes_per_token"] < 250


def test_demo_names_its_inputs_before_running(tmp_path):
    """The demo finds no assets by itself: a missing --teacher or --texts is one line naming make demo."""
    with pytest.raises(ValueError, match=r"demo --teacher: expected an existing path, got ''.*make demo"):
        run_demo(DemoConfig(out=str(tmp_path / "demo"), texts=str(tmp_path)))
    with pytest.raises(ValueError, match="demo --texts"):
        run_demo(DemoConfig(out=str(tmp_path / "demo"), teacher=str(tmp_path), texts=str(tmp_path / "none")))
    assert not (tmp_path / "demo").exists()
