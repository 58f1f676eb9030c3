"""benchmarks/on_policy_speed.py: the steps it makes by hand are the training loop's steps (the same completions,
the same loss, step after step), so the ratio it reports compares equal work."""

import argparse

from benchmarks.on_policy_speed import config, one_by_one, summary
from topkd.train.loop import train_step
from topkd.train.run import open_run


def test_the_steps_by_hand_are_the_loops(chat_teacher_dir, chats_file, tmp_path):
    args = argparse.Namespace(
        teacher=chat_teacher_dir, data=chats_file, steps=3, batch_size=2, max_new_tokens=8, layers=1
    )
    loop_run = open_run(config(args, str(tmp_path / "a")), "cpu", 1)
    hand_run = open_run(config(args, str(tmp_path / "b")), "cpu", 1)
    loop = [train_step(loop_run) for _ in range(3)]
    phases = [one_by_one(hand_run, step) for step in range(3)]
    result = summary(loop, phases)
    assert result["same_tokens"] and result["loss_gap_max"] < 1e-5
    assert result["ratio"] > 0 and 0 < result["update_share"] < 1
    assert set(result["tokens_per_s"]) == {"generate", "score", "update", "trained"}
