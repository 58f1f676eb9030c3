"""Online mode: the teacher in memory gives the same training as its cache, up to the cache's quantisation."""

import json
import os

import pytest

from topkd.train import TrainConfig, train

COMMON = dict(
    init_from_teacher=True,
    layers=1,
    steps=3,
    batch_size=2,
    lr=3e-3,
    warmup_steps=1,
    checkpoint_every=0,
    seed=0,
    seq_len=48,
)


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_online_top_k_matches_training_from_its_cache(
    built_cache, teacher_dir, text_file, tmp_path
):
    # the cache was built with seq_len=48, k=16 from text_file: same sequences, same order, same student
    train(TrainConfig(cache=built_cache, out=str(tmp_path / "offline"), **COMMON))
    train(
        TrainConfig(
            teacher=teacher_dir,
            data=[text_file],
            online_k=16,
            out=str(tmp_path / "online"),
            **COMMON,
        )
    )
    offline, online = losses(tmp_path / "offline"), losses(tmp_path / "online")
    # uint8 log-prob codes: KL ~1e-5 nats per token
    assert online == pytest.approx(offline, rel=2e-3)
    assert online != offline


@pytest.mark.parametrize("packing", ["none", "cross"])
def test_online_packing_ablations_match_their_cache(
    documents_cache, teacher_dir, documents_file, tmp_path, packing
):
    common = {**COMMON, "packing": packing}  # seq_len 48: the online teacher packs as the cache did
    train(TrainConfig(cache=documents_cache.path, out=str(tmp_path / "offline"), **common))
    train(
        TrainConfig(
            teacher=teacher_dir,
            data=[documents_file],
            online_k=16,
            out=str(tmp_path / "online"),
            **common,
        )
    )
    assert losses(tmp_path / "online") == pytest.approx(losses(tmp_path / "offline"), rel=2e-3)


def test_full_vocabulary_equals_top_k_with_k_equal_to_v(teacher_dir, text_file, tmp_path):
    full = dict(
        teacher=teacher_dir,
        data=[text_file],
        steps=2,
        **{k: v for k, v in COMMON.items() if k != "steps"},
    )
    train(TrainConfig(online_k=0, out=str(tmp_path / "full"), **full))
    train(TrainConfig(online_k=1000, out=str(tmp_path / "k_eq_v"), **full))
    assert losses(tmp_path / "full") == pytest.approx(losses(tmp_path / "k_eq_v"), rel=1e-5)


def test_tempered_online_kd_runs_without_a_cache(teacher_dir, text_file, tmp_path):
    train(
        TrainConfig(
            teacher=teacher_dir,
            data=[text_file],
            online_k=8,
            temperature=2.0,
            out=str(tmp_path / "t"),
            **{**COMMON, "steps": 1},
        )
    )
    assert len(losses(tmp_path / "t")) == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cache="c"), "exactly one of --cache"),
        (dict(data=[]), "needs --data"),
        (dict(seq_len=0), "needs --data"),
        (dict(online_k=-1), "online_k"),
        (dict(online_k=1001), "online_k: expected 0"),
    ],
)
def test_bad_online_settings_are_refused(teacher_dir, text_file, tmp_path, kw, match):
    opts = {**COMMON, "teacher": teacher_dir, "data": [text_file], "out": str(tmp_path), **kw}
    with pytest.raises(ValueError, match=match):
        train(TrainConfig(**opts))


def test_cache_mode_refuses_online_flags(built_cache, text_file, tmp_path):
    with pytest.raises(ValueError, match="belong to online mode"):
        train(TrainConfig(cache=built_cache, data=[text_file], out=str(tmp_path), **COMMON))
