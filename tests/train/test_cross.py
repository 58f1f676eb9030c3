"""--cross-tokenizer: a tiny student with another BPE vocabulary (and another eos) learns from the tiny teacher's
cache through its text; its rows, refusals, and an exact resume after a real kill."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.cache.tiny import make_teacher
from tests.conftest import cache_config
from tests.train.runs import config, losses, wait_for_rows
from topkd.cache import TopKCache, build
from topkd.train import train
from topkd.train.cross import EXACT, ULD, CrossTokenizerSource


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return make_teacher(
        str(tmp_path_factory.mktemp("student")), vocab=300, head_scale=1.0, seed=3, eos="<|end|>"
    )


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("mode", ["align", "uld"])
def test_the_source_gives_student_rows_that_spell_the_cached_text(
    documents_cache, student_dir, mode
):
    tok = _tokenizer(student_dir)
    source = CrossTokenizerSource(documents_cache, tok, mode)
    item = source[1]
    assert source.vocab_size == len(tok) and source.separator == tok.eos_token_id
    text = documents_cache.sequence(1).text
    pieces = tok.decode(item["input_ids"][item["input_ids"] != tok.eos_token_id].tolist())
    assert pieces == text  # the student's tokens are the cached text (separators aside)
    kinds = item["cross_kind"].numpy()
    assert (kinds == ULD).any() and ((kinds == EXACT).any() == (mode == "align"))
    exact = item["teacher_logprobs"][kinds == EXACT]
    # exact rows keep the teacher's mass on mapped ids: at most 1, and -inf only as padding, last
    assert (exact.exp().sum(1) <= 1 + 1e-5).all()
    uld = item["teacher_logprobs"][kinds == ULD]
    assert (uld[:, :-1] >= uld[:, 1:]).all()  # sorted
    assert sum(source.sequence_lengths()) == source.tokens


def test_a_cross_tokenizer_student_trains_and_both_losses_fall(
    documents_cache, student_dir, tmp_path
):
    runs = {}
    for mode in ("align", "uld"):
        cfg = config(
            documents_cache.path,
            tmp_path / mode,
            init_from_teacher=False,
            layers=0,
            student=student_dir,
            cross_tokenizer=mode,
            steps=12,
            lr=1e-2,
        )
        train(cfg)
        runs[mode] = losses(tmp_path / mode)
        assert os.path.exists(tmp_path / mode / "final" / "tokenizer.json")
    for mode, curve in runs.items():
        assert all(np.isfinite(curve)) and np.mean(curve[-3:]) < np.mean(curve[:3]), (mode, curve)
    assert runs["align"] != runs["uld"]


def test_refusals_before_training(documents_cache, student_dir, teacher_dir, tmp_path):
    cfg = dict(init_from_teacher=False, layers=0, student=student_dir)
    with pytest.raises(ValueError, match="expected one of"):
        train(config(documents_cache.path, tmp_path / "a", cross_tokenizer="byte", **cfg))
    with pytest.raises(ValueError, match="--temperature 1"):
        train(
            config(
                documents_cache.path, tmp_path / "b", cross_tokenizer="uld", temperature=2.0, **cfg
            )
        )
    np.save(tmp_path / "ids.npy", np.arange(300).astype(np.int64) % 300)
    build(cache_config(teacher_dir, str(tmp_path / "ids.npy"), tmp_path / "bare"))
    with pytest.raises(ValueError, match="rebuild the cache with this topkd"):
        train(config(str(tmp_path / "bare"), tmp_path / "c", cross_tokenizer="uld", **cfg))


def test_a_student_tokenizer_that_rewrites_the_text_is_refused(
    documents_cache, student_dir, tmp_path
):
    from tokenizers import normalizers

    tok = _tokenizer(student_dir)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    source = CrossTokenizerSource(documents_cache, tok, "uld")
    with pytest.raises(ValueError, match="spell the cached text back"):
        source.check_student(len(tok), tok)


def test_chat_text_with_the_teachers_markers_is_refused(
    chat_teacher_dir, chats_file, student_dir, tmp_path
):
    build(cache_config(chat_teacher_dir, chats_file, tmp_path / "chat", seq_len=64))
    tok = _tokenizer(student_dir)
    source = CrossTokenizerSource(TopKCache(str(tmp_path / "chat")), tok, "align")
    with pytest.raises(ValueError, match="chat template mismatch"):
        source.check_student(len(tok), tok)


@pytest.mark.once
def test_a_killed_cross_tokenizer_run_resumes_the_same_trajectory(
    documents_cache, student_dir, tmp_path
):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    steps = 24

    def args(out):
        return [
            sys.executable, "-m", "topkd.cli", "train", "--cache", documents_cache.path, "--out", str(out),
            "--student", student_dir, "--cross-tokenizer", "align", "--steps", str(steps),
            "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "2", "--checkpoint-every", "2",
        ]  # fmt: skip

    proc = subprocess.Popen(
        args(tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    wait_for_rows(metrics, 5, proc, timeout=180)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 5 <= sum(1 for _ in open(metrics)) < steps, "the run finished before the kill"
    subprocess.run(args(tmp_path / "killed"), env=env, check=True, capture_output=True)
    subprocess.run(args(tmp_path / "ref"), env=env, check=True, capture_output=True)
    assert (
        losses(tmp_path / "killed") == losses(tmp_path / "ref")
        and len(losses(tmp_path / "ref")) == steps
    )
    run = json.load(open(tmp_path / "ref" / "run.json"))
    assert "align" in json.dumps(run)


def test_kdtrainer_trains_a_cross_tokenizer_student_as_topkd_train_does(
    documents_cache, student_dir, tmp_path
):
    """A TopKDataset over the CrossTokenizerSource, in HF Trainer: the same losses as topkd train, step by step."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from tests.test_hf import _cpu_args
    from topkd import TopKDataset
    from topkd.hf import KDTrainer
    from topkd.loss import LossOptions
    from topkd.train.optim import lr_factor, param_groups

    cfg = config(
        documents_cache.path,
        tmp_path / "topkd",
        init_from_teacher=False,
        layers=0,
        student=student_dir,
        cross_tokenizer="align",
        ce_weight=0.5,
        steps=6,
    )
    train(cfg)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(student_dir).float()
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    source = CrossTokenizerSource(documents_cache, _tokenizer(student_dir), "align")
    args = _cpu_args(
        output_dir=str(tmp_path / "hf"),
        max_steps=6,
        per_device_train_batch_size=2,
        logging_steps=1,
        max_grad_norm=cfg.clip,
        seed=0,
    )
    trainer = KDTrainer(
        model=model,
        args=args,
        train_dataset=TopKDataset(source, seed=cfg.seed),
        optimizers=(optimizer, scheduler),
        loss=LossOptions(ce_weight=0.5),
    )
    trainer.train()
    logs = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert logs == pytest.approx(losses(tmp_path / "topkd"), rel=1e-4)
