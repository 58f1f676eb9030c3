"""Training from the cache on a tiny teacher: learning, pinned losses, exact resume after a kill, accumulation."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import topkd
from topkd.cache import TopKCache
from topkd.data.samples import SampleStream
from topkd.train import TrainConfig, train
from topkd.train.loop import train_step
from topkd.train.student import KDStudent, cut_layers, load_student


def config(cache, out, **kw):
    opts = dict(cache=cache, out=str(out), init_from_teacher=True, layers=1, steps=4, batch_size=2, grad_accum=1,
                lr=3e-3, warmup_steps=1, checkpoint_every=0, seed=0)
    opts.update(kw)
    return TrainConfig(**opts)


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_loss_decreases_and_outputs_are_written(built_cache, tmp_path):
    train(config(built_cache, tmp_path, steps=40, seq_len=24, batch_size=4))
    curve = losses(tmp_path)
    assert len(curve) == 40 and sum(curve[-5:]) < 0.8 * sum(curve[:5])
    assert (tmp_path / "loss.png").stat().st_size > 5000 and (tmp_path / "final" / "config.json").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").config.num_hidden_layers == 1


def test_seeded_run_pins_its_first_losses(built_cache, tmp_path):
    train(config(built_cache, tmp_path, steps=3))
    assert losses(tmp_path) == pytest.approx(PINNED, rel=1e-4)


PINNED = [0.4964747, 0.8567317, 0.8202904]  # tiny teacher, seed 0; a change here is a change of behaviour


def _cli(cache, out, steps):
    return [sys.executable, "-m", "topkd.cli", "train", "--cache", cache, "--out", str(out), "--init-from-teacher",
            "--layers", "1", "--steps", str(steps), "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "2",
            "--checkpoint-every", "2", "--seq-len", "24"]


def test_resume_after_a_real_kill_continues_the_same_trajectory(built_cache, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    steps = 60
    proc = subprocess.Popen(_cli(built_cache, tmp_path / "killed", steps), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    metrics = tmp_path / "killed" / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= 7:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sum(1 for _ in open(metrics))
    assert 7 <= done < steps, "the run finished before the kill"
    subprocess.run(_cli(built_cache, tmp_path / "killed", steps), env=env, check=True, capture_output=True)
    subprocess.run(_cli(built_cache, tmp_path / "ref", steps), env=env, check=True, capture_output=True)
    assert losses(tmp_path / "killed") == losses(tmp_path / "ref") and len(losses(tmp_path / "ref")) == steps


def test_accumulation_normalises_by_the_tokens_of_the_whole_step(built_cache, tmp_path):
    cache = TopKCache(built_cache)
    grads = []
    for batch_size, accum in ((4, 1), (2, 2), (1, 4)):
        cfg = config(built_cache, tmp_path, batch_size=batch_size, grad_accum=accum, seq_len=30)
        torch.manual_seed(0)
        student = load_student(cfg, cache)
        module = KDStudent(student.model, cache.vocab_size, dict(divergence="kl", tail="bucket", temperature=1.0,
                                                                  beta=0.5, ce_weight=0.5, impl="fused"))
        opt = torch.optim.SGD(module.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        train_step(module, SampleStream(cache, 30, seed=0), opt, sched, cfg, {"step": 0, "samples": 0})
        grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_cut_layers_keeps_first_and_last(teacher_dir):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    student = cut_layers(teacher, 2)
    assert student.config.num_hidden_layers == 2 and len(teacher.model.layers) == 2
    assert torch.equal(student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[1].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="layers: expected 1..2"):
        cut_layers(teacher, 3)


@pytest.mark.parametrize("kw,match", [(dict(init_from_teacher=False), "exactly one of --student"),
                                      (dict(layers=0), "needs --layers >= 1"), (dict(steps=0), "steps"),
                                      (dict(lr=0.0), "lr > 0"), (dict(student="x"), "exactly one of")])
def test_bad_settings_are_refused(built_cache, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        train(config(built_cache, tmp_path, **kw))


def test_student_with_another_vocabulary_is_refused(built_cache, tmp_path, teacher_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    model.resize_token_embeddings(900)
    model.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="student .*: expected tokenizer files beside the model"):
        train(config(built_cache, tmp_path / "run", init_from_teacher=False, student=str(tmp_path / "small")))
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="expected >= the teacher's 1000"):
        train(config(built_cache, tmp_path / "run", init_from_teacher=False, student=str(tmp_path / "small")))


def test_resume_with_more_steps_follows_the_new_schedule(built_cache, tmp_path):
    train(config(built_cache, tmp_path / "short", steps=2, warmup_steps=1))
    train(config(built_cache, tmp_path / "short", steps=4, warmup_steps=1))
    train(config(built_cache, tmp_path / "long", steps=4, warmup_steps=1))
    extended = [json.loads(line) for line in open(tmp_path / "short" / "metrics.jsonl")]
    fresh = [json.loads(line) for line in open(tmp_path / "long" / "metrics.jsonl")]
    assert [r["step"] for r in extended] == [1, 2, 3, 4]
    assert [r["lr"] for r in extended[2:]] == pytest.approx([r["lr"] for r in fresh[2:]])


def test_top_k_uses_the_first_columns_and_refuses_more_than_k(built_cache, tmp_path):
    cache = TopKCache(built_cache)
    batch = SampleStream(cache, 24, seed=0).batch(0, 2)
    cfg = config(built_cache, tmp_path)
    student = load_student(cfg, cache)
    opts = dict(divergence="kl", tail="bucket", temperature=1.0, beta=0.5, ce_weight=0.0, impl="fused")
    sliced = KDStudent(student.model, cache.vocab_size, opts, top_k=4)(batch)
    narrow = {**batch, "teacher_ids": batch["teacher_ids"][..., :4],
              "teacher_logprobs": batch["teacher_logprobs"][..., :4]}
    assert torch.equal(sliced, KDStudent(student.model, cache.vocab_size, opts)(narrow))
    with pytest.raises(ValueError, match="at most the teacher rows' K=16"):
        train(config(built_cache, tmp_path / "big", top_k=17))


def test_soft_capped_student_trains_on_its_capped_logits(built_cache, tmp_path):
    """A Gemma-2 style student (final_logit_softcapping): the loss is that of c tanh(z / c), not of z."""
    cache = TopKCache(built_cache)
    torch.manual_seed(0)
    model = load_student(config(built_cache, tmp_path), cache).model
    model.config.final_logit_softcapping = 2.0
    batch = SampleStream(cache, 30, seed=0).batch(0, 2)
    opts = dict(divergence="kl", tail="bucket", temperature=1.0, beta=0.5, ce_weight=0.0, impl="fused")
    loss = KDStudent(model, cache.vocab_size, opts)(batch)
    hidden = model.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    head = model.get_output_embeddings().weight[: cache.vocab_size]
    args = (hidden, head, batch["teacher_ids"], batch["teacher_logprobs"])
    want = topkd.fused_linear_kd(*args, mask=batch["mask"], reduction="sum", impl="dense", softcap=2.0)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert abs(loss.item() - topkd.fused_linear_kd(*args, mask=batch["mask"], reduction="sum").item()) > 1e-3
    with pytest.raises(ValueError, match="objective='ce': expected a student without final logit soft-capping"):
        KDStudent(model, cache.vocab_size, opts, objective="ce")


def test_autocast_bf16_trains_through_masked_tokens(documents_cache, tmp_path):
    """--autocast-bf16 crashed on the first masked token (separator rows are masked)."""
    row = train(config(documents_cache.path, tmp_path, steps=2, autocast_bf16=True))
    assert row["step"] == 2 and row["loss"] == row["loss"]


def test_bf16_head_runs_the_loss_gemms_in_bf16_and_updates_fp32_masters(built_cache, tmp_path, monkeypatch):
    """head_dtype=bf16 (what --autocast-bf16 sets): the loss sees bf16 hidden and weight, the fp32 master weights
    get fp32 gradients, and the loss is the fp32 loss to bf16 accuracy."""
    import topkd.train.student as student_module

    cache = TopKCache(built_cache)
    cfg = config(built_cache, tmp_path)
    torch.manual_seed(0)
    model = load_student(cfg, cache).model
    batch = SampleStream(cache, 30, seed=0).batch(0, 2)
    opts = dict(divergence="kl", tail="bucket", temperature=1.0, beta=0.5, ce_weight=0.0, impl="fused")
    seen, real = [], student_module.fused_linear_kd
    monkeypatch.setattr(student_module, "fused_linear_kd", lambda h, w, *a, **k: seen.append((h.dtype, w.dtype))
                        or real(h, w, *a, **k))
    full = KDStudent(model, cache.vocab_size, opts)(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = KDStudent(model, cache.vocab_size, opts, head_dtype=torch.bfloat16)(batch)
    low.backward()
    assert seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
    head = model.get_output_embeddings().weight
    assert head.dtype == head.grad.dtype == torch.float32 and bool(head.grad.abs().sum() > 0)
    assert abs(low.item() - full.item()) <= 2e-2 * abs(full.item())
