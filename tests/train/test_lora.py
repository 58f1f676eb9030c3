"""`topkd train --lora-rank`: only adapters change, the loss decreases, adapters/base/merged model written;
a frozen lm_head costs the loss no dW GEMM (counted); refusals."""

import json
import os
import sys

import pytest
import torch

import topkd
from tests.train.runs import config, losses
from topkd.base.trace import OpTrace
from topkd.train import train
from topkd.train.config import check_config


@pytest.mark.parametrize("trainable", [True, False])
def test_a_frozen_head_skips_the_dw_gemm(trainable):
    n, v, h, k = 37, 101, 16, 5
    x = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=trainable)
    ids = torch.stack([torch.randperm(v)[:k] for _ in range(n)])
    logprobs = torch.log_softmax(torch.randn(n, k), -1) - 0.1
    with OpTrace() as trace:
        topkd.fused_linear_kd(x, w, ids, logprobs).backward()
    gemm_flops = sum(op.flops for op in trace.ops if op.kind == "gemm")
    assert gemm_flops == (6 if trainable else 4) * n * v * h  # logits, dX (and dW)
    assert (w.grad is not None) == trainable


def test_lora_flags_are_checked_before_anything_loads(built_cache, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--merge go with --lora-rank R"):
        check_config(config(built_cache, tmp_path, merge=True))
    with pytest.raises(ValueError, match="report_to: expected one of"):
        check_config(config(built_cache, tmp_path, report_to="mlflow"))
    with pytest.raises(ValueError, match="--lora-alpha: expected a number >= 0"):
        check_config(config(built_cache, tmp_path, lora_rank=4, lora_alpha=-8))
    with pytest.raises(
        ValueError, match=r"--lora-targets: expected modules of the body, got \['lm_head'\]"
    ):
        check_config(config(built_cache, tmp_path, lora_rank=4, lora_targets=["q_proj", "lm_head"]))
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ValueError, match=r"--lora-rank: expected the peft package.*topkd\[hf\]"):
        check_config(config(built_cache, tmp_path, lora_rank=4))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="expected one process, got 2 under torchrun"):
        check_config(config(built_cache, tmp_path, lora_rank=4))


@pytest.mark.slow  # needs the extra topkd[hf] (peft)
def test_lora_trains_only_adapters_and_writes_them(built_cache, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from topkd.cache import TopKCache
    from topkd.train.student import cut_layers

    train(config(built_cache, tmp_path, steps=12, seq_len=24, lr=1e-2, lora_rank=4))
    # adapters and base only, until --merge
    assert not os.path.exists(tmp_path / "final" / "config.json")
    recorded = json.load(open(tmp_path / "final" / "adapter" / "adapter_config.json"))[
        "base_model_name_or_path"
    ]
    assert recorded == str(tmp_path / "final" / "base")  # absolute, and the base it was trained on
    # resumes at 12
    train(config(built_cache, tmp_path, steps=12, seq_len=24, lr=1e-2, lora_rank=4, merge=True))
    curve = losses(tmp_path)
    assert sum(curve[-3:]) < sum(curve[:3])
    before = cut_layers(TopKCache(built_cache).load_teacher().model, 1).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    changed = {n for n in before if not torch.allclose(before[n], merged[n])}
    # adapters fold into the Linear layers only
    assert changed and all(n.endswith("proj.weight") for n in changed)
    assert torch.equal(before["lm_head.weight"], merged["lm_head.weight"])
    adapter = json.load(open(tmp_path / "final" / "adapter" / "adapter_config.json"))
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "base")
    # the untouched base, as it was
    assert all(torch.equal(before[n], t) for n, t in base.state_dict().items())
    with_adapter = (
        PeftModel.from_pretrained(base, tmp_path / "final" / "adapter")
        .merge_and_unload()
        .state_dict()
    )
    assert all(torch.allclose(with_adapter[n], merged[n], atol=1e-6) for n in merged)
    assert os.path.exists(tmp_path / "final" / "adapter" / "tokenizer.json")


def test_an_unmerged_lora_run_is_named_as_such_with_how_to_load_it(tmp_path):
    """topkd eval --model RUN/final of a run without --merge: transformers' error said nothing of adapters."""
    from topkd.eval.run import EvalConfig, run_eval

    (tmp_path / "final" / "adapter").mkdir(parents=True)
    (tmp_path / "final" / "base").mkdir()
    with pytest.raises(
        ValueError,
        match=r"got LoRA adapters .* for the base model in .*final/base; rerun the same "
        "topkd train command with --merge",
    ):
        run_eval(EvalConfig(model=str(tmp_path / "final"), text=[__file__]))
    with pytest.raises(ValueError, match="expected a model directory with config.json"):
        run_eval(EvalConfig(model=str(tmp_path / "final" / "base"), text=[__file__]))
