"""A GGUF teacher works everywhere a model directory does (cache build, the cut student, online mode, eval),
on a tiny GGUF file the tests write; refusals of directories that are not models."""

import json

import numpy as np
import pytest
import torch

from tests.conftest import cache_config
from tests.train.runs import config, losses
from topkd.cache import TopKCache, build
from topkd.models import load_causal_lm


def test_a_gguf_teacher_is_the_same_model_and_a_plain_one(gguf_teacher, teacher_dir):
    """transformers keeps a dequantised GGUF model marked quantized: .float() refused it ("`.float()` is not
    supported for quantized model"), which failed --init-from-teacher with the only teacher make assets gives."""
    model, tokenizer = load_causal_lm(gguf_teacher, role="teacher")
    plain, _ = load_causal_lm(teacher_dir)
    ids = torch.tensor([tokenizer("the king and the queen")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    model.float().to(torch.bfloat16)
    assert not getattr(model, "is_quantized", False) and not hasattr(
        model.config, "quantization_config"
    )


def test_a_gguf_teacher_builds_trains_online_and_evaluates(
    gguf_teacher, built_cache, text_file, tmp_path
):
    from topkd.eval.run import EvalConfig, run_eval
    from topkd.train import train

    build(cache_config(gguf_teacher, text_file, tmp_path / "cache"))
    cache, plain = TopKCache(str(tmp_path / "cache")), TopKCache(built_cache)
    assert cache.fingerprint["teacher"].endswith("teacher.gguf") and cache.verify() == []
    # the same rows as the directory's
    assert torch.equal(cache[3]["teacher_ids"], plain[3]["teacher_ids"])
    # --init-from-teacher cuts the GGUF
    train(config(str(tmp_path / "cache"), tmp_path / "cut", steps=3))
    assert losses(tmp_path / "cut") == pytest.approx(
        losses_of(built_cache, tmp_path / "ref"), rel=1e-5
    )
    saved = json.load(open(tmp_path / "cut" / "final" / "config.json"))
    assert "quantization_config" not in saved  # a plain model directory, loadable anywhere
    online = config(
        "",
        tmp_path / "online",
        steps=3,
        teacher=gguf_teacher,
        data=[text_file],
        online_k=16,
        seq_len=48,
    )
    train(online)
    assert np.isfinite(losses(tmp_path / "online")).all()
    result = run_eval(
        EvalConfig(
            model=gguf_teacher,
            text=[text_file],
            cache=str(tmp_path / "cache"),
            max_tokens=200,
            max_sequences=2,
        )
    )
    assert result["vs_teacher"]["kl_bucket"] < 1e-3 and result["text"]["bits_per_byte"] > 0


def losses_of(cache, out):
    from topkd.train import train

    train(config(cache, out, steps=3))
    return losses(out)


@pytest.mark.parametrize("which", ["directory", "gguf"])
def test_seq_len_beyond_the_teachers_positions_is_refused_before_it_loads(
    teacher_dir, gguf_teacher, text_file, tmp_path, monkeypatch, which
):
    """It was refused only after loading the model (49 s for the demo's teacher): config.json or the GGUF
    header say it first."""
    import importlib

    from topkd.models import model_positions

    teacher = teacher_dir if which == "directory" else gguf_teacher
    assert model_positions(teacher) == 512
    engines = importlib.import_module("topkd.cache.building.engines")
    monkeypatch.setattr(
        engines, "load_teacher", lambda *a, **k: pytest.fail("the teacher was loaded")
    )
    with pytest.raises(ValueError, match="expected at most the teacher's 512 positions"):
        build(cache_config(teacher, text_file, tmp_path / "c", seq_len=4096))
