"""topkd.hf.KDTrainer: the same per-step losses as `topkd train` on the same samples, schedule and accumulation;
accumulation 1x4 == 4x1; teacher columns kept; hidden states only; kd_loss/ce_loss logged; PEFT students."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.train.runs import config, losses
from topkd import TopKDataset
from topkd.cache import TopKCache
from topkd.loss import LossOptions
from topkd.train import train
from topkd.train.optim import lr_factor, param_groups
from topkd.train.student import cut_layers

transformers = pytest.importorskip("transformers")
from topkd.hf import KDTrainer  # noqa: E402


def _student(cache_dir: str):
    model = cut_layers(TopKCache(cache_dir).load_teacher().model, 1).float()
    model.config.use_cache = False
    return model


def _hf_run(cache_dir, out, cfg, batch, accum, steps, **loss):
    """KDTrainer with topkd train's optimizer and schedule (AdamW, decay on matrices, warmup + cosine)."""
    model = _student(cache_dir)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    args = _cpu_args(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        logging_steps=1,
        max_grad_norm=cfg.clip,
        seed=0,
    )
    data = TopKDataset(
        TopKCache(cache_dir),
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        temperature=loss.get("temperature") if loss.get("temperature", 1.0) != 1.0 else None,
    )
    trainer = KDTrainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizers=(optimizer, scheduler),
        loss=LossOptions(**loss),
    )
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    return logs, model


def _cpu_args(**kw) -> "transformers.TrainingArguments":
    """TrainingArguments for a test run: CPU, no reporting, no checkpoints, no progress bar."""
    return transformers.TrainingArguments(
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, **kw
    )


def test_twenty_steps_match_topkd_train(built_cache, tmp_path):
    loss = dict(divergence="kl", temperature=2.0, ce_weight=0.1)
    cfg = config(
        built_cache, tmp_path / "topkd", steps=20, seq_len=20, batch_size=2, grad_accum=2, **loss
    )
    # one epoch: both read it in order
    assert len(TopKDataset(TopKCache(built_cache), seq_len=20)) >= 20 * 4
    train(cfg)
    logs, _ = _hf_run(built_cache, tmp_path / "hf", cfg, batch=2, accum=2, steps=20, **loss)
    assert [row["loss"] for row in logs] == pytest.approx(losses(tmp_path / "topkd"), rel=1e-5)
    rows = [json.loads(line) for line in open(tmp_path / "topkd" / "metrics.jsonl")]
    for name in ("kd_loss", "ce_loss"):  # the same split of the loss, logged by both
        assert [row[name] for row in logs] == pytest.approx([row[name] for row in rows], rel=1e-5)
    assert [r["kd_loss"] + 0.1 * r["ce_loss"] for r in rows] == pytest.approx(
        [r["loss"] for r in rows], rel=1e-5
    )


def test_accumulation_one_by_four_equals_four_by_one(built_cache, tmp_path):
    cfg = config(built_cache, tmp_path, steps=3, seq_len=24)
    one, model_a = _hf_run(built_cache, tmp_path / "a", cfg, batch=4, accum=1, steps=3)
    four, model_b = _hf_run(built_cache, tmp_path / "b", cfg, batch=1, accum=4, steps=3)
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in four], rel=1e-5)
    # Adam divides by sqrt(v): a near-zero gradient entry summed in another order can move its weight by a visible
    # fraction of lr, so weights agree to 1e-3 of the three steps' largest move (lr 3e-3), not to float rounding
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-3 * 3 * cfg.lr), (
            name,
            float((a - b).abs().max()),
        )


def test_the_model_computes_logits_for_one_position_only(built_cache, tmp_path):
    cfg = config(built_cache, tmp_path, steps=1, seq_len=24)
    seen = []
    model = _student(built_cache)
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    args = _cpu_args(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2)
    KDTrainer(
        model=model,
        args=args,
        train_dataset=TopKDataset(TopKCache(built_cache), seq_len=cfg.seq_len),
    ).train()
    # [B, 1, V]: the loss projects the hidden states itself
    assert seen and all(shape[1] == 1 for shape in seen)


def test_batches_without_teacher_columns_are_refused(built_cache, tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[]
    )
    trainer = KDTrainer(model=_student(built_cache), args=args)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="KDTrainer: expected batches with the teacher's columns"):
        trainer.compute_loss(trainer.model, batch)
    with pytest.raises(ValueError, match="temperature=2.0 with tail='bucket' needs teacher_logz"):
        KDTrainer(
            model=_student(built_cache), args=args, loss=LossOptions(temperature=2.0)
        ).compute_loss(
            trainer.model, {**batch, "kd_mask": 1, "teacher_ids": 1, "teacher_logprobs": 1}
        )


def test_a_zero3_partitioned_head_is_refused_with_the_remedy():
    from topkd.loss.options import LossOptions
    from topkd.train.student import batch_loss

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(8, 29, bias=False)
            self.lm_head.weight = torch.nn.Parameter(torch.empty(0))
            self.lm_head.weight.ds_id = 3  # what DeepSpeed ZeRO-3 leaves outside the forward
            self.config = type("C", (), {})()

        def get_output_embeddings(self):
            return self.lm_head

    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3 partition.*FSDP2"):
        batch_loss(Head(), torch.randn(1, 2, 8), {}, LossOptions(reduction="sum"))


SHARDED_HEAD = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from topkd.loss.options import LossOptions
from topkd.train.student import batch_loss
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
class Head(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 29, bias=False)
        self.lm_head.weight = torch.nn.Parameter(w)
        self.config = type("C", (), {})()
    def get_output_embeddings(self):
        return self.lm_head
w = torch.randn(29, 8)
plain, sharded = Head(w.clone()), Head(distribute_tensor(w.clone(), mesh, [Shard(0)]))
hidden = torch.randn(1, 5, 8)
batch = {"teacher_ids": torch.stack([torch.randperm(29)[:4] for _ in range(5)])[None],
         "teacher_logprobs": torch.full((1, 5, 4), -2.0),
         "kd_mask": torch.ones(1, 5, dtype=torch.bool)}
losses = [batch_loss(m, hidden, batch, LossOptions(reduction="sum")) for m in (plain, sharded)]
for loss in losses:
    loss.backward()
grad = sharded.lm_head.weight.grad
assert type(grad).__name__ == "DTensor", type(grad)
assert torch.allclose(losses[0], losses[1]) and torch.allclose(plain.lm_head.weight.grad, grad.full_tensor())
print("ok")
"""


def test_an_fsdp2_sharded_head_is_gathered_with_its_gradient(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-c", SHARDED_HEAD],
        env={**os.environ, "PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.strip().endswith("ok"), run.stderr[-2000:]


@pytest.mark.slow  # needs the extra topkd[hf] (peft), which make test-slow installs
def test_a_peft_student_trains_only_its_adapters(built_cache, tmp_path):
    peft = pytest.importorskip("peft")
    # the adapters' init draws from the global generator: not from whatever ran before
    torch.manual_seed(0)
    model = peft.get_peft_model(
        _student(built_cache),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = _cpu_args(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
    )
    trainer = KDTrainer(
        model=model, args=args, train_dataset=TopKDataset(TopKCache(built_cache), seq_len=24)
    )
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    curve = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert sum(curve[-3:]) < sum(curve[:3])
    json.dumps(trainer.state.log_history)  # logs are plain numbers


@pytest.mark.slow  # needs the extra topkd[hf] (trl)
def test_trl_sft_trainer_takes_the_mixin(built_cache, tmp_path):
    trl = pytest.importorskip("trl")
    from topkd.hf import KDTrainerMixin, as_hf_dataset

    class KDSFTTrainer(KDTrainerMixin, trl.SFTTrainer):
        pass

    cfg = config(built_cache, tmp_path / "topkd", steps=4, seq_len=20, batch_size=2, ce_weight=0.1)
    train(cfg)
    model = _student(built_cache)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    # SFTConfig's default: bf16
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=1,
        max_grad_norm=cfg.clip,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    data = as_hf_dataset(TopKDataset(TopKCache(built_cache), seq_len=20))
    trainer = KDSFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizers=(optimizer, scheduler),
        processing_class=TopKCache(built_cache).load_teacher().tokenizer,
        loss=LossOptions(ce_weight=0.1),
    )
    trainer.train()
    logged = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert logged == pytest.approx(losses(tmp_path / "topkd"), rel=1e-5)


def test_a_student_with_another_tokenizer_of_the_same_vocabulary_size_is_refused(
    built_cache, tmp_path, capfd
):
    """KDTrainer trained it silently (Llama-2 and Mistral-7B are both V=32,000); it now checks as topkd train does."""
    from tokenizers import Tokenizer

    tok = TopKCache(built_cache).load_teacher().tokenizer
    vocab = tok.get_vocab()  # the same size, other ids: two tokens swapped
    a, b = sorted(vocab, key=vocab.get)[300:302]
    swapped = json.loads(tok.backend_tokenizer.to_str())
    swapped["model"]["vocab"][a], swapped["model"]["vocab"][b] = vocab[b], vocab[a]
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(swapped)), eos_token="<eos>"
    )
    args = _cpu_args(output_dir=str(tmp_path / "hf"), max_steps=1)
    data = TopKDataset(TopKCache(built_cache), seq_len=24)
    with pytest.raises(ValueError, match="student tokenizer: expected the teacher's token ids"):
        KDTrainer(model=_student(built_cache), args=args, train_dataset=data, processing_class=tok)
    # its own, found beside the model
    KDTrainer(model=_student(built_cache), args=args, train_dataset=data)
    model = _student(built_cache)
    model.config._name_or_path = ""
    KDTrainer(model=model, args=args, train_dataset=data)
    assert "only its vocabulary size was checked" in capfd.readouterr().err
    with pytest.raises(ValueError, match="student vocabulary: expected >= the teacher's"):
        model.resize_token_embeddings(10)
        KDTrainer(model=model, args=args, train_dataset=data)


def test_a_dataset_of_lists_is_refused_with_the_way_to_a_topkdataset(built_cache, tmp_path):
    data = TopKDataset(TopKCache(built_cache), seq_len=24)
    rows = [{k: v.tolist() for k, v in data[i].items()} for i in range(4)]
    args = _cpu_args(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(
        ValueError, match="expected torch tensors, got input_ids: list.*topkd.TopKDataset"
    ):
        KDTrainer(model=_student(built_cache), args=args, train_dataset=rows).train()


def test_the_temperature_is_stated_once_on_the_dataset(built_cache, tmp_path):
    """Given to TopKDataset and KDTrainer both, a mismatch failed only at the first step."""
    args = _cpu_args(output_dir=str(tmp_path), max_steps=1)
    tempered = TopKDataset(built_cache, seq_len=24, temperature=2.0)  # a path is a cache
    trainer = KDTrainer(model=_student(built_cache), args=args, train_dataset=tempered)
    assert trainer.kd_options.temperature == 2.0
    # 1.0 is the default, but a LossOptions states it: refused, not overridden
    for given in (3.0, 1.0):
        with pytest.raises(
            ValueError,
            match=rf"loss.temperature={given}, but the dataset carries c_T for T=2.0.*"
            r"loss=LossOptions\(temperature=2.0",
        ):
            KDTrainer(
                model=_student(built_cache),
                args=args,
                train_dataset=tempered,
                loss=LossOptions(temperature=given),
            )
    assert (
        KDTrainer(
            model=_student(built_cache),
            args=args,
            train_dataset=tempered,
            loss=LossOptions(temperature=2.0, ce_weight=0.1),
        ).kd_options.ce_weight
        == 0.1
    )
    with pytest.raises(
        ValueError, match=r"build the dataset with TopKDataset\(cache, temperature=2.0\)"
    ):
        KDTrainer(
            model=_student(built_cache),
            args=args,
            train_dataset=TopKDataset(built_cache),
            loss=LossOptions(temperature=2.0),
        )


def test_loss_keywords_of_old_are_refused_with_the_loss_options_to_pass(built_cache, tmp_path):
    """KDTrainer(divergence=..., ce_weight=...) went to transformers.Trainer and failed there, naming neither."""
    args = _cpu_args(output_dir=str(tmp_path), max_steps=1)
    with pytest.raises(
        TypeError,
        match=r"got divergence='jsd', ce_weight=0.1 as keywords; pass "
        r"loss=topkd.LossOptions\(divergence='jsd', ce_weight=0.1\)",
    ):
        KDTrainer(model=_student(built_cache), args=args, divergence="jsd", ce_weight=0.1)
    with pytest.raises(TypeError, match="expected loss=topkd.LossOptions"):
        KDTrainer(model=_student(built_cache), args=args, loss={"divergence": "jsd"})


@pytest.mark.slow  # needs the extra topkd[hf] (datasets)
def test_a_wrapped_dataset_is_checked_and_carries_its_temperature(built_cache, tmp_path):
    """as_hf_dataset (the TRL route) hid the cache from KDTrainer's student check."""
    pytest.importorskip("datasets")
    from topkd.hf import as_hf_dataset

    args = _cpu_args(output_dir=str(tmp_path), max_steps=1)
    wrapped = as_hf_dataset(TopKDataset(built_cache, seq_len=24, temperature=2.0))
    assert (
        KDTrainer(
            model=_student(built_cache), args=args, train_dataset=wrapped
        ).kd_options.temperature
        == 2.0
    )
    small = _student(built_cache)
    small.resize_token_embeddings(10)
    with pytest.raises(ValueError, match="student vocabulary: expected >= the teacher's"):
        KDTrainer(model=small, args=args, train_dataset=wrapped)


def test_a_sampled_cache_refuses_what_its_targets_cannot_train_with(
    teacher_dir, text_file, tmp_path
):
    """As `topkd train` refuses: reverse KL, a temperature, a top_k on sampled rows (count / N at T = 1)."""
    from tests.conftest import cache_config
    from topkd.cache import build

    build(
        cache_config(
            teacher_dir,
            text_file,
            tmp_path / "c",
            targets="sampled",
            samples=8,
            temperatures=[],
            max_sequences=4,
        )
    )
    args = _cpu_args(output_dir=str(tmp_path / "hf"), max_steps=1)
    data = TopKDataset(str(tmp_path / "c"), seq_len=24)
    for bad in (
        {"loss": LossOptions(divergence="reverse_kl")},
        {"loss": LossOptions(temperature=2.0, tail="renorm")},
        {"top_k": 4},
    ):
        with pytest.raises(
            ValueError,
            match=r"KDTrainer: the dataset's cache .* holds sampled targets .* expected "
            r"divergence kl\|jsd\|tvd, temperature 1 and no top_k",
        ):
            KDTrainer(model=_student(str(tmp_path / "c")), args=args, train_dataset=data, **bad)
    KDTrainer(
        model=_student(str(tmp_path / "c")),
        args=args,
        train_dataset=data,
        loss=LossOptions(divergence="jsd"),
    )
