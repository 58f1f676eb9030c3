"""On-policy training: the student's own completions, scored by the teacher in memory, are what trains; a step's
rows by hand; λ = 0 is online training exactly; λ mixes seeded steps; a killed run resumes bit-identically;
refusals of flags that would be ignored and modes it cannot run."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import cache_config
from tests.train.runs import wait_for_rows
from topkd.cache import build
from topkd.train import TrainConfig, train
from topkd.train.on_policy import completion_item
from topkd.train.run import open_run

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
COMMON = dict(
    online_k=16,
    init_from_teacher=True,
    layers=1,
    steps=4,
    batch_size=2,
    lr=3e-3,
    warmup_steps=1,
    checkpoint_every=0,
    seq_len=96,
)


def config(chat_teacher_dir, chats_file, out, **kw) -> TrainConfig:
    opts = {**COMMON, "on_policy": True, "max_new_tokens": 12, "divergence": "reverse_kl", **kw}
    return TrainConfig(teacher=chat_teacher_dir, data=[chats_file], out=str(out), **opts)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_only_the_rows_predicting_a_written_token_count():
    class Rows:
        ids = np.arange(12, dtype=np.int32).reshape(6, 2)
        logprobs = np.full((6, 2), -1.0, np.float32)
        logz = np.zeros((6, 1), np.float32)
        scored = None

    tokens = np.array([10, 11, 12, 20, 21, 22])  # a prompt of 3, a completion of 3
    item = completion_item(tokens, 3, Rows, logz_column=0)
    assert item["kd_mask"].tolist() == [False, False, True, True, True, False]
    assert item["labels"].tolist() == [-100, -100, 20, 21, 22, -100]
    assert item["position_ids"].tolist() == list(range(6)) and item["teacher_logz"].shape == (6,)
    Rows.scored = np.array(
        [True, True, True, False, True, True]
    )  # a row a served teacher did not score
    item = completion_item(tokens, 3, Rows, logz_column=0)
    assert (
        item["kd_mask"].tolist() == [False, False, True, False, True, False] and not item["scored"]
    )
    assert item["labels"].tolist() == [-100, -100, 20, -100, 22, -100]


def test_a_step_trains_on_the_teachers_rows_of_the_students_own_completion(
    chat_teacher_dir, chats_file, tmp_path
):
    cfg = config(chat_teacher_dir, chats_file, tmp_path / "run")
    run = open_run(cfg, "cpu", 1)
    policy = run.on_policy
    (batch,), made = policy.step_batches(run.module.model, 0, 0, 1, 2, 1, 0)
    assert made["completions"] == 2 and 2 <= made["generated_tokens"] <= 24
    teacher = policy.teacher.teacher
    for b in range(2):
        prompt = policy.prompt(b)
        counted = torch.nonzero(batch["kd_mask"][b])[:, 0]
        assert (
            counted[0] == len(prompt) - 1
        )  # the row of the assistant header's last token: the first written
        n = int(counted[-1]) + 2  # prompt + completion
        tokens = batch["input_ids"][b, :n]
        assert torch.equal(tokens[: len(prompt)], torch.from_numpy(prompt))
        # the teacher's own top 16 on prompt + completion, one sequence alone, unpadded
        alone = teacher.topk_rows(tokens[None], 16)
        for name, want in (("teacher_ids", alone.ids), ("teacher_logprobs", alone.logprobs)):
            np.testing.assert_array_equal(batch[name][b, counted].numpy(), want[counted.numpy()])
        assert torch.equal(batch["labels"][b, counted], tokens[counted + 1])


def test_fraction_zero_is_online_training_exactly(chat_teacher_dir, chats_file, tmp_path):
    online = {
        **COMMON,
        "teacher": chat_teacher_dir,
        "data": [chats_file],
        "out": str(tmp_path / "a"),
    }
    train(TrainConfig(**online))
    train(
        config(
            chat_teacher_dir, chats_file, tmp_path / "b", on_policy_fraction=0.0, divergence="kl"
        )
    )
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and not any("on_policy" in r for r in b)


def test_a_fraction_mixes_seeded_steps_with_offline_ones(chat_teacher_dir, chats_file, tmp_path):
    cfg = config(chat_teacher_dir, chats_file, tmp_path / "run", on_policy_fraction=0.5, steps=8)
    train(cfg)
    got = [bool(r.get("on_policy")) for r in rows(tmp_path / "run")]
    policy = open_run(cfg, "cpu", 1).on_policy
    assert got == [policy.chooses(step) for step in range(8)] and 0 < sum(got) < 8
    for r in rows(tmp_path / "run"):
        if r.get("on_policy"):
            assert (
                r["generate_s"] > 0 and r["update_s"] > 0 and r["tokens"] == r["generated_tokens"]
            )
            assert r["completion_len"] == r["generated_tokens"] / 2


@pytest.fixture(scope="module")
def chat_cache(chat_teacher_dir, chats_file, tmp_path_factory):
    """The chat teacher's top-16 cache of the same conversations (what --cache mixes in)."""
    out = tmp_path_factory.mktemp("chat-cache") / "cache"
    build(cache_config(chat_teacher_dir, chats_file, out, seq_len=96, temperatures=[]))
    return str(out)


def test_fraction_zero_with_a_cache_is_offline_training_exactly(
    chat_teacher_dir, chats_file, chat_cache, tmp_path
):
    offline = {k: v for k, v in COMMON.items() if k not in ("online_k", "seq_len")}
    train(TrainConfig(cache=chat_cache, out=str(tmp_path / "a"), **offline))
    mixed = config(
        chat_teacher_dir,
        chats_file,
        tmp_path / "b",
        cache=chat_cache,
        on_policy_fraction=0.0,
        divergence="kl",
        seq_len=0,
    )
    train(mixed)
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and not any("on_policy" in r for r in b)


def test_a_fraction_mixes_on_policy_steps_with_the_caches(
    chat_teacher_dir, chats_file, chat_cache, tmp_path
):
    cfg = config(
        chat_teacher_dir,
        chats_file,
        tmp_path / "run",
        cache=chat_cache,
        on_policy_fraction=0.5,
        steps=8,
        seq_len=0,  # the cache's 96
    )
    train(cfg)
    got = [bool(r.get("on_policy")) for r in rows(tmp_path / "run")]
    run = open_run(cfg, "cpu", 1)
    assert got == [run.on_policy.chooses(step) for step in range(8)] and 0 < sum(got) < 8
    assert (
        run.on_policy.teacher is not run.stream.source
    )  # the teacher scores; the cache feeds the rest
    state = json.load(open(tmp_path / "run" / "final" / "config.json"))  # a student was saved
    assert state["vocab_size"] == run.stream.source.vocab_size


def test_a_teacher_with_other_ids_than_the_caches_is_refused(
    chat_teacher_dir, chats_file, chat_cache, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = str(tmp_path / "other-teacher")  # the chat teacher and one more special token
    tok = AutoTokenizer.from_pretrained(chat_teacher_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|x|>"]})
    model = AutoModelForCausalLM.from_pretrained(chat_teacher_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(
        ValueError, match="expected the tokenizer and vocabulary of the teacher that"
    ):
        train(config(other, chats_file, tmp_path / "run", cache=chat_cache, seq_len=0))


def _cli(chat_teacher_dir, chats_file, out, steps):
    return [
        sys.executable,
        "-m",
        "topkd.cli",
        "train",
        "--on-policy",
        "--teacher",
        chat_teacher_dir,
        "--data",
        chats_file,
        "--online-k",
        "16",
        "--init-from-teacher",
        "--layers",
        "1",
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--seq-len",
        "96",
        "--max-new-tokens",
        "24",
        "--divergence",
        "reverse_kl",
        "--checkpoint-every",
        "2",
        "--lr",
        "3e-3",
    ] + ["--out", str(out)]


@pytest.mark.once
def test_a_killed_on_policy_run_resumes_bit_identically(chat_teacher_dir, chats_file, tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    subprocess.run(
        _cli(chat_teacher_dir, chats_file, ref, 30), env=ENV, check=True, capture_output=True
    )
    proc = subprocess.Popen(
        _cli(chat_teacher_dir, chats_file, killed, 30),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_rows(killed / "metrics.jsonl", 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(rows(killed)) < 30, "the run ended before the kill: give it more steps"
    subprocess.run(
        _cli(chat_teacher_dir, chats_file, killed, 30), env=ENV, check=True, capture_output=True
    )
    keys = ("step", "loss", "grad_norm", "generated_tokens", "tokens")
    assert [[r[k] for k in keys] for r in rows(killed)] == [[r[k] for k in keys] for r in rows(ref)]


@pytest.mark.parametrize(
    "kw,words",
    [
        (
            {"on_policy": False, "max_new_tokens": 8},
            "--max-new-tokens: expected only with --on-policy, got --max-new-tokens 8 without it",
        ),
        ({"objective": "ce"}, "--on-policy: expected --teacher .* and --objective kd"),
        ({"on_policy_fraction": 1.5}, "expected 0 <= --on-policy-fraction <= 1"),
        ({"max_new_tokens": 96}, "--max-new-tokens below --seq-len, got .* 96 and --seq-len 96"),
    ],
)
def test_what_it_cannot_run_is_refused_before_loading(
    chat_teacher_dir, chats_file, tmp_path, kw, words
):
    with pytest.raises(ValueError, match=words):
        train(config(chat_teacher_dir, chats_file, tmp_path / "run", **kw))
    assert not (tmp_path / "run").exists()


def test_text_data_has_no_turn_to_write(chat_teacher_dir, text_file, tmp_path):
    with pytest.raises(ValueError, match="--on-policy: expected chat JSONL files"):
        train(config(chat_teacher_dir, text_file, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_under_another_divergence_the_teachers_reverse_kl_is_logged(
    chat_teacher_dir, chats_file, tmp_path
):
    train(config(chat_teacher_dir, chats_file, tmp_path / "rkl", steps=1))
    train(config(chat_teacher_dir, chats_file, tmp_path / "kl", steps=1, divergence="kl"))
    (rkl,), (kl,) = rows(tmp_path / "rkl"), rows(tmp_path / "kl")
    assert "teacher_rkl" not in rkl  # its loss is that quantity
    # step 1 of both: the same init writes the same completions; the kl run measures what the other trains on
    assert kl["generated_tokens"] == rkl["generated_tokens"]
    assert kl["teacher_rkl"] == pytest.approx(rkl["loss"], rel=1e-5) and kl["loss"] != rkl["loss"]


def test_sampled_teacher_rows_train_on_policy_and_draw_the_same_again(
    chat_teacher_dir, chats_file, tmp_path
):
    kw = dict(online_k=0, online_samples=16, divergence="kl")
    run = open_run(config(chat_teacher_dir, chats_file, tmp_path / "a", **kw), "cpu", 1)
    (batch,), _ = run.on_policy.step_batches(run.module.model, 0, 0, 1, 2, 1, 0)
    probs = batch["teacher_logprobs"].exp()
    assert (
        batch["teacher_ids"].shape[-1] == 16 and run.on_policy.teacher.target_kind.name == "sampled"
    )
    counted = batch["kd_mask"]
    # count / 16 of 16 draws: rows sum to one, every value a multiple of 1/16
    assert torch.allclose(probs.sum(-1)[counted], torch.ones(()), atol=1e-5)
    assert torch.allclose((probs * 16)[counted], (probs * 16)[counted].round(), atol=1e-4)
    train(config(chat_teacher_dir, chats_file, tmp_path / "b", **kw))
    train(config(chat_teacher_dir, chats_file, tmp_path / "c", **kw))
    assert [r["loss"] for r in rows(tmp_path / "b")] == [r["loss"] for r in rows(tmp_path / "c")]
    with pytest.raises(
        ValueError, match="--online-samples: sampled targets .* expected divergence kl"
    ):
        train(config(chat_teacher_dir, chats_file, tmp_path / "d", online_k=0, online_samples=16))
    with pytest.raises(
        ValueError, match="--online-samples: expected the in-memory --teacher and no --online-k"
    ):
        train(config(chat_teacher_dir, chats_file, tmp_path / "e", online_samples=16))
