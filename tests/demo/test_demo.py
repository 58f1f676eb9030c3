"""`topkd demo --quick` end to end on the tiny teacher (CI); the real SmolLM2 + Shakespeare run is a slow test."""

import json
import os

import pytest

from tests.assets import PLAYS, SMOLLM2, asset
from tests.cache.tiny import make_chat_teacher, make_text
from topkd.demo.run import DemoConfig, gap_closed, run_demo


def plays(tmp_path):
    """Fake plays in the Gutenberg layout: speeches are blocks headed by an abbreviated speaker name."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, name in enumerate(
        ["hamlet_gut.txt", "lear_gut.txt", "macbeth_gut.txt", "lear_gut_f.txt"]
    ):
        words = make_text(900, seed=i).split()
        blocks = [
            f"{('Ham.', 'Hor.', 'Mar.')[j % 3]}\n{' '.join(words[j * 12 : (j + 1) * 12])}"
            for j in range(75)
        ]
        (texts / name).write_text("\n\n".join(blocks) + "\n")
    return str(texts)


def test_quick_demo_runs_every_step_and_reports(teacher_dir, tmp_path, capsys):
    teacher = make_chat_teacher(teacher_dir, str(tmp_path / "chat-teacher"))
    cfg = DemoConfig(
        out=str(tmp_path / "demo"),
        quick=True,
        teacher=teacher,
        texts=plays(tmp_path),
        layers=1,
        seq_len=32,
        k=16,
    )
    report = run_demo(cfg)
    students = {"student-kd", "student-sampled", "student-ce"}
    assert set(report["models"]) == {"teacher", "student-init"} | students
    kl = {name: m["text"]["kl_full"] for name, m in report["models"].items()}
    assert kl["teacher"] < 1e-3 < kl["student-init"]
    # distillation moved the students towards the teacher, on either kind of targets
    assert kl["student-kd"] < kl["student-init"] and kl["student-sampled"] < kl["student-init"]
    assert (
        report["caches"]["sampled"]["targets"] == "sampled" and set(report["training"]) == students
    )
    assert report["gap_closed"] == gap_closed(report["models"])
    for name in ("report.txt", "report.json", "demo.png", "timings.json"):
        assert os.path.getsize(tmp_path / "demo" / name) > 0
    chat = report["chat"]
    assert 0 < chat["counted_fraction"] < 1 and chat["conversations"] == {"train": 24, "heldout": 8}
    assert set(chat["models"]) == {"teacher", "student-init", "student-kd", "student-ce"}
    assert (
        chat["models"]["teacher"]["kl_bucket"] < 1e-3 < chat["models"]["student-init"]["kl_bucket"]
    )
    out = capsys.readouterr().out
    assert "bits/byte" in out and "KD sampled N=50" in out and "gap %" in out
    assert "held-out chat" in (tmp_path / "demo" / "report.txt").read_text()
    again = run_demo(cfg)  # every step is done: a rerun only re-reads and re-reports
    assert again["models"] == json.loads(json.dumps(report["models"]))


@pytest.mark.slow
def test_quick_demo_on_smollm2_and_shakespeare(tmp_path):
    report = run_demo(
        DemoConfig(
            out=str(tmp_path / "demo"), quick=True, teacher=asset(SMOLLM2), texts=asset(PLAYS)
        )
    )
    kl = {name: m["vs_teacher"]["kl_bucket"] for name, m in report["models"].items()}
    assert kl["teacher"] < 1e-3 and kl["student-kd"] < kl["student-init"]
    assert report["cache"]["bytes_per_token"] < 250


def test_demo_names_its_inputs_before_running(tmp_path):
    """The demo finds no assets by itself: a missing --teacher or --texts is one line naming make demo."""
    with pytest.raises(
        ValueError, match=r"demo --teacher: expected an existing path, got ''.*make demo"
    ):
        run_demo(DemoConfig(out=str(tmp_path / "demo"), texts=str(tmp_path)))
    with pytest.raises(ValueError, match="demo --texts"):
        run_demo(
            DemoConfig(
                out=str(tmp_path / "demo"), teacher=str(tmp_path), texts=str(tmp_path / "none")
            )
        )
    assert not (tmp_path / "demo").exists()


def test_gap_closed_is_the_share_of_the_ce_students_gap_to_the_teacher():
    def scores(**bpb):
        return {name.replace("_", "-"): {"text": {"bits_per_byte": v}} for name, v in bpb.items()}

    got = gap_closed(scores(teacher=1.5, student_init=6.0, student_ce=2.5, student_kd=2.25))
    assert got == {"student-kd": pytest.approx(0.25)}
    # CE already as good as the (tiny, random) teacher: no gap to close, none reported
    assert gap_closed(scores(teacher=3.0, student_ce=2.5, student_kd=2.25)) == {}
