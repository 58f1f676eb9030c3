"""`topkd train --report-to`: TensorBoard event files hold metrics.jsonl's values (a resume appends without
duplicates), a wandb run is written offline and continued by id; a missing package is named up front."""

import glob
import os
import sys

import pytest

from tests.train.runs import config, losses
from topkd.train import train
from topkd.train.report import require_reporter


def test_a_missing_package_is_named_before_anything_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(
        ValueError, match=r"--report-to tensorboard: expected the tensorboard package.*topkd\[hf\]"
    ):
        require_reporter("tensorboard")
    require_reporter("none")


@pytest.mark.slow  # needs the extra topkd[hf] (tensorboard)
def test_tensorboard_events_match_metrics_and_a_resume_appends(built_cache, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        config(
            built_cache, tmp_path, steps=3, seq_len=24, checkpoint_every=1, report_to="tensorboard"
        )
    )
    train(
        config(
            built_cache, tmp_path, steps=5, seq_len=24, checkpoint_every=1, report_to="tensorboard"
        )
    )
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == pytest.approx(losses(tmp_path), rel=1e-6)
    assert {"train/kd_loss", "train/lr", "train/grad_norm"} <= set(events.Tags()["scalars"])


@pytest.mark.slow  # needs the extra topkd[hf] (wandb)
def test_wandb_runs_offline_and_resumes_the_same_run(built_cache, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train(config(built_cache, tmp_path, steps=2, seq_len=24, checkpoint_every=1, report_to="wandb"))
    run_id = (tmp_path / "wandb_id").read_text()
    train(config(built_cache, tmp_path, steps=3, seq_len=24, checkpoint_every=1, report_to="wandb"))
    assert (tmp_path / "wandb_id").read_text() == run_id
    records = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(records) >= 1 and all(os.path.getsize(r) > 0 for r in records)
    written = b"".join(open(r, "rb").read() for r in records)
    assert b"kd_loss" in written and b"grad_norm" in written


def test_loss_png_names_the_run_and_its_objective(tmp_path):
    """KD and CE plots looked alike: no title, almost no tick labels on the log axis."""
    import json

    from topkd.train import TrainConfig
    from topkd.train.report import plot_losses
    from topkd.train.run import run_title

    assert (
        run_title(TrainConfig(out="runs/kd-a", ce_weight=0.1))
        == "kd-a: KD kl, tail bucket, T=1, ce_weight 0.1"
    )
    assert (
        run_title(TrainConfig(out="runs/ce/", objective="ce"))
        == "ce: cross entropy only (no teacher)"
    )
    rows = [
        {"step": s, "loss": 2.0 / s, "kd_loss": 1.5 / s, "ce_loss": 5.0 / s} for s in range(1, 20)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_losses(str(tmp_path / "metrics.jsonl"), str(tmp_path / "loss.png"), "kd-a: KD kl")
    assert (tmp_path / "loss.png").stat().st_size > 10000
