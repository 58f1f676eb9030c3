"""Every command on every target kind: top-K, sampled, hybrid (sampled with an exact head) and top-p caches.

    python -m pytest tests/test_target_kinds.py     # ~1 min: four tiny caches, then each command on each

A matrix (command x target kind), so that no kind can fall behind again: `cache inspect` (histograms that make
sense for the kind), `cache verify` (and a flipped byte found), `cache export` (refused, with the reason, where
Axolotl's format cannot hold the rows) and `cache import` of what was exported, `topkd train`, `topkd eval
--cache`, KDTrainer and TopKDataset.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import cache_config
from tests.train.runs import config, losses
from topkd import TopKDataset
from topkd.cache import TopKCache, build
from topkd.cli import main

KINDS = {
    "topk": {},
    "sampled": {"targets": "sampled", "samples": 16},
    "hybrid": {"targets": "sampled", "samples": 16, "head": 4},
    "topp": {"targets": "topp", "top_p": 0.9, "min_k": 2},
}


@pytest.fixture(scope="module")
def caches(teacher_dir, text_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    out = {}
    for kind, options in KINDS.items():
        path = root / kind
        build(
            cache_config(teacher_dir, text_file, path, temperatures=[], max_sequences=8, **options)
        )
        out[kind] = str(path)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_prints_what_the_kind_holds(caches, kind, tmp_path, capsys):
    assert main(["cache", "inspect", caches[kind], "--plot", str(tmp_path / "m.png")]) == 0
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])
    cache = TopKCache(caches[kind])
    assert line["targets"] == cache.targets and line["tokens"] == cache.tokens
    assert 1 <= line["width_mean"] <= cache.k and (tmp_path / "m.png").stat().st_size > 5000
    if kind in ("sampled", "hybrid"):
        assert "draws per token" in out and "distinct ids drawn per counted token" in out
        assert line["mass_mean"] == pytest.approx(1.0, abs=1e-4)  # count / N rows hold all the mass
    if kind == "hybrid":
        assert "the 4 most likely ids exact" in out
    if kind in ("topk", "topp"):
        assert "kept mass" in out and 0 < line["mass_mean"] < 1
    if kind == "topp":
        assert "p >= 0.9" in out and line["width_mean"] < cache.k  # adaptive: fewer ids than K


@pytest.mark.parametrize("kind", KINDS)
def test_verify_passes_then_finds_a_flipped_byte(caches, kind, tmp_path):
    assert main(["cache", "verify", caches[kind]]) == 0
    copy = shutil.copytree(caches[kind], tmp_path / "c")
    shard = copy / "shards" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["cache", "verify", str(copy)]) == 1


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "topk"])
def test_export_refuses_rows_of_variable_k_with_the_reason(caches, kind, tmp_path, capsys):
    assert main(["cache", "export", caches[kind], "--out", str(tmp_path / "ax")]) == 2
    err = capsys.readouterr().err
    targets = TopKCache(caches[kind]).targets
    assert f"expected top-K targets for the Axolotl format, got {targets} targets" in err
    assert "Traceback" not in err and not (tmp_path / "ax").exists()


def test_a_topk_cache_exports_and_imports_back(caches, teacher_dir, tmp_path):
    pytest.importorskip("datasets")
    assert main(["cache", "export", caches["topk"], "--out", str(tmp_path / "ax")]) == 0
    vocab = str(TopKCache(caches["topk"]).vocab_size)
    argv = ["cache", "import", str(tmp_path / "ax"), "--tokenizer", teacher_dir]
    assert main(argv + ["--vocab-size", vocab, "--out", str(tmp_path / "imp")]) == 0
    assert TopKCache(str(tmp_path / "imp")).verify() == []


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_on_the_cache(caches, kind, tmp_path):
    from topkd.eval import EvalConfig, run_eval
    from topkd.train import train

    train(config(caches[kind], tmp_path / "run", steps=2, seq_len=24))
    assert np.isfinite(losses(tmp_path / "run")).all()
    model = os.path.join(tmp_path, "run", "final")
    result = run_eval(EvalConfig(model=model, cache=caches[kind], out=str(tmp_path / "e.json")))
    scores = result["vs_teacher"]
    assert all(np.isfinite(v) for v in scores.values()), scores
    assert scores["kl_bucket"] >= 0 and 0 <= scores["top1_agreement"] <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_topk_dataset_rows_are_distributions(caches, kind):
    data = TopKDataset(caches[kind], seq_len=24)
    row = data[0]
    real = torch.isfinite(row["teacher_logprobs"])
    mass = row["teacher_logprobs"].double().masked_fill(~real, -torch.inf).exp().sum(-1)
    assert (real.sum(-1) >= 1).all() and (mass <= 1 + 1e-4).all()
    if kind in ("sampled", "hybrid"):
        assert torch.allclose(mass, torch.ones_like(mass), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_kd_trainer_takes_a_step(caches, kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    from topkd.hf import KDTrainer
    from topkd.train.student import cut_layers

    model = cut_layers(TopKCache(caches[kind]).load_teacher().model, 1).float()
    model.config.use_cache = False
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        per_device_train_batch_size=2,
    )
    trainer = KDTrainer(model=model, args=args, train_dataset=TopKDataset(caches[kind], seq_len=24))
    assert np.isfinite(trainer.train().training_loss)
