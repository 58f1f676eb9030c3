"""The student module: cut layers, vocabulary and top-K checks, soft-capping, the bf16 head."""

import dataclasses

import pytest
import torch

import topkd
from tests.train.runs import config
from topkd.cache import TopKCache
from topkd.data.samples import SampleStream
from topkd.loss import LossOptions
from topkd.train import train
from topkd.train.student import KDStudent, cut_layers, load_student


def test_cut_layers_keeps_first_and_last(teacher_dir):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    student = cut_layers(teacher, 2)
    assert student.config.num_hidden_layers == 2 and len(teacher.model.layers) == 2
    assert torch.equal(
        student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[1].mlp.up_proj.weight
    )
    with pytest.raises(ValueError, match="layers: expected 1..2"):
        cut_layers(teacher, 3)


def test_student_with_another_vocabulary_is_refused(built_cache, tmp_path, teacher_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    model.resize_token_embeddings(900)
    model.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="student .*: expected tokenizer files beside the model"):
        train(
            config(
                built_cache,
                tmp_path / "run",
                init_from_teacher=False,
                student=str(tmp_path / "small"),
            )
        )
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(tmp_path / "small")
    with pytest.raises(
        ValueError, match="expected >= the teacher's 1000 rows, or more than every id the cache"
    ):
        train(
            config(
                built_cache,
                tmp_path / "run",
                init_from_teacher=False,
                student=str(tmp_path / "small"),
            )
        )


def test_a_qwen_shaped_pair_trains_the_smaller_head(teacher_dir, text_file, tmp_path):
    """Teacher embedding rows = student's + 128 (padding the tokenizer never produces, as Qwen2.5 7B -> 3B):
    the cache records that no id reaches the padding, so the student's smaller head trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import cache_config
    from topkd.cache import build

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    teacher.resize_token_embeddings(1128)
    # padding rows at logit 0: far below every row the top-K keeps, like trained padding
    with torch.no_grad():
        teacher.get_output_embeddings().weight[1000:] = 0.0
    teacher.save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(tmp_path / "teacher")
    build(cache_config(str(tmp_path / "teacher"), text_file, tmp_path / "cache"))
    cache = TopKCache(str(tmp_path / "cache"))
    assert cache.vocab_size == 1128 and cache.max_id < 1000
    student = cut_layers(teacher, 1)
    student.resize_token_embeddings(1000)
    student.save_pretrained(tmp_path / "student")
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(tmp_path / "student")
    train(
        config(
            str(tmp_path / "cache"),
            tmp_path / "run",
            init_from_teacher=False,
            student=str(tmp_path / "student"),
            steps=3,
            seq_len=24,
        )
    )
    assert (
        AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
        .get_output_embeddings()
        .weight.shape[0]
        == 1000
    )
    # now some cached teacher ids lie beyond the student's head
    student.resize_token_embeddings(cache.max_id)
    student.save_pretrained(tmp_path / "smaller")
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(tmp_path / "smaller")
    smaller = dict(init_from_teacher=False, student=str(tmp_path / "smaller"), steps=2, seq_len=24)
    with pytest.raises(ValueError, match=rf"largest: {cache.max_id}\), got {cache.max_id}"):
        train(config(str(tmp_path / "cache"), tmp_path / "refused", **smaller))
    train(config(str(tmp_path / "cache"), tmp_path / "folded", fold_beyond_vocab=True, **smaller))
    # scored as it was trained: the folded ids in the tail
    from topkd.eval.run import EvalConfig, run_eval

    scored = EvalConfig(model=str(tmp_path / "folded" / "final"), cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="or pass --fold-beyond-vocab"):
        run_eval(scored)
    result = run_eval(dataclasses.replace(scored, fold_beyond_vocab=True))["vs_teacher"]
    assert (
        result["tokens"] > 0 and 0 < result["kl_bucket"] < 20 and 0 <= result["top1_agreement"] <= 1
    )


def test_folding_ids_beyond_the_student_is_exact_in_the_bucket_loss():
    """fold_beyond == the bucket KL (float64, by hand) with the teacher's mass on ids >= V_student in the tail."""
    from topkd.loss.options import LossOptions
    from topkd.train.student import batch_loss

    g = torch.Generator().manual_seed(0)
    n, k, v_teacher, v_student, h = 7, 6, 50, 40, 8
    ids = torch.stack([torch.randperm(v_teacher, generator=g)[:k] for _ in range(n)])
    ids[0, :3] = torch.tensor([45, 46, 47])  # a row with several folded entries
    logprobs = torch.log_softmax(torch.randn(n, v_teacher, generator=g) * 2, -1).gather(1, ids)
    hidden, weight = (
        torch.randn(1, n, h, generator=g),
        torch.randn(v_student, h, generator=g, requires_grad=True),
    )

    class Student(torch.nn.Module):
        config = type("C", (), {})()

        def get_output_embeddings(self):
            return type("Head", (), {"weight": weight, "bias": None})()

    batch = {
        "teacher_ids": ids[None],
        "teacher_logprobs": logprobs[None],
        "kd_mask": torch.ones(1, n, dtype=bool),
    }
    loss = batch_loss(
        Student(), hidden, batch, LossOptions(reduction="sum"), fold_beyond_vocab=True
    )
    loss.backward()
    q = torch.softmax(hidden[0].double() @ weight.detach().double().T, -1)
    expected = 0.0
    for row in range(n):
        kept = ids[row] < v_student
        p, qk = logprobs[row][kept].double().exp(), q[row, ids[row][kept]]
        p_tail, q_tail = 1 - p.sum(), 1 - qk.sum()
        expected += float((p * (p / qk).log()).sum() + p_tail * (p_tail / q_tail).log())
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert weight.grad.shape == (v_student, h) and torch.isfinite(weight.grad).all()


def test_top_k_uses_the_first_columns_and_refuses_more_than_k(built_cache, tmp_path):
    cache = TopKCache(built_cache)
    batch = SampleStream(cache, 24, seed=0).batch(0, 2)
    cfg = config(built_cache, tmp_path)
    student = load_student(cfg, cache)
    opts = LossOptions()
    sliced = KDStudent(student.model, cache.vocab_size, opts, top_k=4)(batch)
    narrow = {
        **batch,
        "teacher_ids": batch["teacher_ids"][..., :4],
        "teacher_logprobs": batch["teacher_logprobs"][..., :4],
    }
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
    opts = LossOptions()
    loss = KDStudent(model, cache.vocab_size, opts)(batch)
    hidden = model.get_decoder()(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"]
    ).last_hidden_state
    head = model.get_output_embeddings().weight[: cache.vocab_size]
    args = (hidden, head, batch["teacher_ids"], batch["teacher_logprobs"])
    want = topkd.fused_linear_kd(
        *args, mask=batch["kd_mask"], reduction="sum", impl="dense", softcap=2.0
    )
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert (
        abs(
            loss.item()
            - topkd.fused_linear_kd(*args, mask=batch["kd_mask"], reduction="sum").item()
        )
        > 1e-3
    )
    with pytest.raises(
        ValueError, match="objective='ce': expected a student without final logit soft-capping"
    ):
        KDStudent(model, cache.vocab_size, opts, objective="ce")


def test_bf16_head_runs_the_loss_gemms_in_bf16_and_updates_fp32_masters(
    built_cache, tmp_path, monkeypatch
):
    """head_dtype=bf16 (what --autocast-bf16 sets): the loss sees bf16 hidden and weight, the fp32 master weights
    get fp32 gradients, and the loss is the fp32 loss to bf16 accuracy."""
    import topkd.train.student as student_module

    cache = TopKCache(built_cache)
    cfg = config(built_cache, tmp_path)
    torch.manual_seed(0)
    model = load_student(cfg, cache).model
    batch = SampleStream(cache, 30, seed=0).batch(0, 2)
    opts = LossOptions()
    seen, real = [], student_module.kd_loss
    monkeypatch.setattr(
        student_module,
        "kd_loss",
        lambda h, w, *a, **k: seen.append((h.dtype, w.dtype)) or real(h, w, *a, **k),
    )
    full = KDStudent(model, cache.vocab_size, opts)(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = KDStudent(model, cache.vocab_size, opts, head_dtype=torch.bfloat16)(batch)
    low.backward()
    assert seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
    head = model.get_output_embeddings().weight
    assert head.dtype == head.grad.dtype == torch.float32 and bool(head.grad.abs().sum() > 0)
    assert abs(low.item() - full.item()) <= 2e-2 * abs(full.item())


@pytest.mark.parametrize("with_bias", [False, True])
def test_ce_without_torchs_linear_cross_entropy_is_topkds_fused_ce(monkeypatch, with_bias):
    """torch < 2.12 has no F.linear_cross_entropy: objective='ce' falls back to the fused loss at K = 1."""
    from topkd.train.student import linear_cross_entropy_sum

    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(37, 16, generator=g), torch.randn(101, 16, generator=g)
    bias = torch.randn(101, generator=g) if with_bias else None
    labels = torch.randint(0, 101, (37,), generator=g)
    labels[::5] = -100
    logits = (hidden.double() @ weight.double().t()) + (0 if bias is None else bias.double())
    want = torch.nn.functional.cross_entropy(logits, labels, reduction="sum", ignore_index=-100)
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy", raising=False)
    got = linear_cross_entropy_sum(hidden, weight, bias, labels)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    all_ignored = linear_cross_entropy_sum(hidden, weight, bias, torch.full_like(labels, -100))
    assert float(all_ignored) == 0.0
