"""A cache never serves wrong data: tempered targets of a sharp teacher, edited manifests, shards swapped in
from elsewhere, malformed manifests, paths out of the cache, and every repair a rerun of the build performs."""

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.cache.tiny import make_teacher
from tests.conftest import cache_config
from topkd.cache import CacheError, TopKCache, build
from topkd.cache.building.repair import build_lock

SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


@pytest.fixture
def cache_copy(built_cache, tmp_path):
    return str(shutil.copytree(built_cache, tmp_path / "copy"))


def _digests(root, sub="shards") -> dict:
    import hashlib

    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((root / sub).glob("*"))
    }


def _edit_manifest(root, edit) -> None:
    path = os.path.join(root, "manifest.json")
    manifest = json.load(open(path))
    edit(manifest)
    json.dump(manifest, open(path, "w"))


@pytest.mark.parametrize("temperature", [2.0, 4.0])
def test_sharp_teacher_gives_exact_tempered_mass_and_close_targets(
    text_file, tmp_path, temperature
):
    """Top-1 near 1 everywhere: the entries far down were clamped to 16.6 nats before, and at T>1 the decoded
    tempered head mass exceeded 1 (the loss refused the row). Now mass is exact and the targets close."""
    from transformers import AutoModelForCausalLM

    import topkd

    teacher = make_teacher(str(tmp_path / "sharp"), head_scale=4000.0)
    out = tmp_path / "c"
    build(cache_config(teacher, text_file, out, temperatures=[2.0, 4.0], max_sequences=3))
    cache = TopKCache(str(out))
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    col = cache.temperatures.index(temperature)
    for i in range(len(cache)):
        row = cache[i]
        with torch.no_grad():
            logp = torch.log_softmax(model(row["input_ids"][None]).logits[0].double(), -1)
        sharp = logp.max(-1).values.exp() > 0.99
        assert sharp.float().mean() > 0.8, "the teacher is not sharp enough for this test"
        exact_t = torch.log_softmax(logp / temperature, -1)  # the tempered teacher, full vocabulary
        head = exact_t.gather(1, row["teacher_ids"])
        p = torch.cat([head.exp(), 1 - head.exp().sum(1, keepdim=True)], 1)
        got = (
            row["teacher_logprobs"].double() / temperature - row["logz"][:, col : col + 1].double()
        )
        q = torch.cat([got.exp(), 1 - got.exp().sum(1, keepdim=True)], 1)
        assert torch.allclose(q[:, -1], p[:, -1], atol=1e-5), (
            "tempered tail (and so head) mass not exact"
        )
        kl = (p * (p.clamp_min(1e-300).log() - q.clamp_min(1e-300).log())).sum(1)
        assert kl.max() < 2e-3, f"tempered targets off by KL {kl.max():.3g}"
        hidden = torch.randn(len(got), model.config.hidden_size)
        loss = topkd.fused_linear_kd(
            hidden,
            model.lm_head.weight.detach(),
            row["teacher_ids"],
            row["teacher_logprobs"],
            teacher_logz=row["logz"][:, col],
            temperature=temperature,
        )
        assert torch.isfinite(loss)
    # the README's recipe, which crashed mid-run on such a cache: tempered bucket KD trains
    if temperature == 2.0:
        from topkd.train import TrainConfig, train

        row = train(
            TrainConfig(
                cache=str(out),
                out=str(tmp_path / "run"),
                init_from_teacher=True,
                layers=1,
                steps=3,
                batch_size=2,
                temperature=2.0,
                tail="bucket",
                checkpoint_every=0,
            )
        )
        assert row["step"] == 3 and np.isfinite(row["loss"])


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["build"].update(seq_len=m["build"]["seq_len"] + 1),
        lambda m: m["build"].update(separator=1),
        lambda m: m["fingerprint"].update(temperatures=[3.0]),
        lambda m: m["fingerprint"].update(weights_sha256="0" * 64),
        lambda m: m["build"]["data"][0].update(sha256="0" * 64),
    ],
    ids=["seq_len", "separator", "temperatures", "teacher", "data"],
)
def test_edited_manifest_settings_are_refused(cache_copy, edit):
    _edit_manifest(cache_copy, edit)
    with pytest.raises(CacheError, match="changed after the build"):
        TopKCache(cache_copy)
    res = subprocess.run(
        [sys.executable, "-m", "topkd.cli", "cache", "verify", cache_copy],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
    )
    assert (
        res.returncode == 2
        and "changed after the build" in res.stderr
        and "Traceback" not in res.stderr
    )


def test_a_manifest_format_version_its_shards_lack_is_refused_and_a_rebuild_rewrites_it(
    cache_copy, teacher_dir, text_file
):
    from topkd.cache.format.manifest import READABLE_VERSIONS

    before = json.load(open(os.path.join(cache_copy, "manifest.json")))
    other = next(v for v in READABLE_VERSIONS if v != before["format_version"])
    _edit_manifest(cache_copy, lambda m: m.update(format_version=other))
    with pytest.raises(
        CacheError,
        match=rf"format_version {other} does not match its shards' \(v{before['format_version']}",
    ):
        TopKCache(cache_copy)
    build(cache_config(teacher_dir, text_file, cache_copy))  # the same command: repaired
    assert json.load(open(os.path.join(cache_copy, "manifest.json"))) == before


def test_a_max_id_lowered_below_the_ids_a_shard_holds_is_refused_on_read(cache_copy):
    """max_id decides which student heads may read the cache: a lowered one would let a small head index past
    its rows."""

    def lower(m):
        for side in m["shards"]:
            side["max_id"] = 5

    _edit_manifest(cache_copy, lower)
    cache = TopKCache(cache_copy)
    assert cache.max_id == 5  # what check_student would trust
    with pytest.raises(
        CacheError,
        match=r"shard-00000.safetensors sequence 0 holds token id \d+, past the max_id 5",
    ):
        cache[0]


def test_edited_build_hash_is_refused_by_the_shards_themselves(cache_copy):
    """An attacker who recomputes the build hash after editing must also rewrite every shard's own bytes."""
    from topkd.cache.format import manifest as mf

    def edit(m):
        m["build"]["seq_len"] += 1
        m["build_hash"] = mf.build_hash(m["fingerprint"], m["build"])
        for side in m["shards"]:
            side["build_hash"] = m["build_hash"]

    _edit_manifest(cache_copy, edit)
    with pytest.raises(CacheError, match="another cache, build or position"):
        TopKCache(cache_copy)


def test_shard_swapped_in_from_another_cache_or_position_is_refused(
    cache_copy, teacher_dir, text_file, tmp_path
):
    other = tmp_path / "other"
    build(cache_config(teacher_dir, text_file, other, seqs_per_shard=4, k=8))
    for source in (
        other / "shards" / "shard-00001.safetensors",
        os.path.join(cache_copy, "shards", "shard-00002.safetensors"),
    ):
        victim = os.path.join(cache_copy, "shards", "shard-00001.safetensors")
        shutil.copy(source, victim + ".new")
        os.replace(victim + ".new", victim)
        from topkd.base.files import file_sha256

        def edit(m):  # the attacker edits size and checksum into manifest and sidecar
            m["shards"][1].update(bytes=os.path.getsize(victim), sha256=file_sha256(victim))
            m["totals"]["bytes"] = sum(s["bytes"] for s in m["shards"])

        _edit_manifest(cache_copy, edit)
        with pytest.raises(CacheError, match="another cache, build or position"):
            TopKCache(cache_copy)


@pytest.mark.parametrize(
    "name", ["../../outside.safetensors", "/etc/passwd", "shards/../manifest.json"]
)
def test_shard_names_outside_the_cache_are_refused_without_revealing_anything(cache_copy, name):
    _edit_manifest(cache_copy, lambda m: m["shards"][0].update(file=name))
    with pytest.raises(CacheError) as err:
        TopKCache(cache_copy)
    assert "expected shard 0 in file 'shards/shard-00000.safetensors'" in str(err.value)
    assert "missing" not in str(err.value) and "bytes" not in str(err.value).split("got")[-1]


def test_symlinked_shard_out_of_the_cache_is_refused(cache_copy, tmp_path):
    shard = os.path.join(cache_copy, "shards", "shard-00000.safetensors")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    os.symlink(outside, shard)
    with pytest.raises(CacheError, match="not a plain file of this cache") as err:
        TopKCache(cache_copy)
    assert str(tmp_path / "elsewhere") not in str(err.value)


def _mutations(manifest: dict, rng: random.Random):
    """Random structural damage: drop a key, change a value's type, or change its value, at any depth."""
    paths = []

    def walk(node, path):
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            paths.append(path + [key])
            if isinstance(value, (dict, list)):
                walk(value, path + [key])

    walk(manifest, [])
    path = rng.choice(paths)
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    kind = rng.choice(["drop", "type", "value"])
    if kind == "drop":
        del parent[path[-1]]
    elif kind == "type":
        parent[path[-1]] = rng.choice([None, "x", 1.5, [], {}, True, -1])
    else:
        value = parent[path[-1]]
        parent[path[-1]] = (
            value + 1 if isinstance(value, int) else (value[::-1] if isinstance(value, str) else [])
        )


def test_randomly_damaged_manifests_are_refused_cleanly(cache_copy):
    original = json.load(open(os.path.join(cache_copy, "manifest.json")))
    rng = random.Random(0)
    refused = 0
    for _ in range(120):
        manifest = json.loads(json.dumps(original))
        _mutations(manifest, rng)
        json.dump(manifest, open(os.path.join(cache_copy, "manifest.json"), "w"))
        try:
            TopKCache(cache_copy).verify()
        except CacheError:
            refused += 1
    assert refused >= 100  # a few mutations (e.g. of free text) change nothing that matters


def test_verify_answers_a_malformed_manifest_in_one_line(cache_copy):
    open(os.path.join(cache_copy, "manifest.json"), "w").write(
        '{"format": "topkd-topk-cache", "format_version": 2}'
    )
    res = subprocess.run(
        [sys.executable, "-m", "topkd.cli", "cache", "verify", cache_copy],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
    )
    assert (
        res.returncode == 2
        and "Traceback" not in res.stderr
        and len(res.stderr.strip().splitlines()) == 1
    )


def _damage(root, how: str) -> None:
    shard = os.path.join(root, "shards", "shard-00002.safetensors")
    if how == "deleted":
        os.remove(shard)
    elif how == "truncated":
        open(shard, "r+b").truncate(os.path.getsize(shard) - 10)
    elif how == "bitflip":
        data = bytearray(open(shard, "rb").read())
        data[-5] ^= 0x10
        open(shard, "wb").write(data)
    elif how == "swapped":
        shutil.copy(os.path.join(root, "shards", "shard-00003.safetensors"), shard)
    elif how == "manifest-empty":
        open(os.path.join(root, "manifest.json"), "w").close()
    elif how == "manifest-malformed":
        _edit_manifest(root, lambda m: m.pop("shards"))
    # still hashes as tokenizer_sha256 (vocabulary and special tokens only)
    elif how == "tokenizer-merges":
        _drop_merges(os.path.join(root, "tokenizer", "tokenizer.json"))
    elif how == "tokenizer-file-deleted":
        os.remove(os.path.join(root, "tokenizer", "tokenizer_config.json"))


def _drop_merges(path) -> None:
    tok = json.load(open(path))
    tok["model"]["merges"] = []
    json.dump(tok, open(path, "w"))


@pytest.mark.parametrize(
    "how",
    [
        "deleted",
        "truncated",
        "bitflip",
        "swapped",
        "manifest-empty",
        "manifest-malformed",
        "tokenizer-merges",
        "tokenizer-file-deleted",
    ],
)
def test_rerunning_the_build_repairs_a_damaged_cache(
    built_cache, teacher_dir, text_file, tmp_path, how
):
    from pathlib import Path

    root = tmp_path / "c"
    shutil.copytree(built_cache, root)
    _damage(str(root), how)
    build(cache_config(teacher_dir, text_file, root))
    assert _digests(root) == _digests(Path(built_cache))
    assert _digests(root, "tokenizer") == _digests(Path(built_cache), "tokenizer")
    assert json.load(open(root / "manifest.json")) == json.load(
        open(Path(built_cache) / "manifest.json")
    )
    assert TopKCache(str(root)).verify() == []


def _edit_sidecar(root, j, edit) -> None:
    path = root / "shards" / f"shard-{j:05d}.json"
    side = json.load(open(path))
    edit(side)
    json.dump(side, open(path, "w"))


@pytest.mark.parametrize("how", ["structure", "tokens", "counted", "build_hash"])
def test_damaged_sidecar_in_an_unfinished_build_is_redone(
    built_cache, teacher_dir, text_file, tmp_path, how
):
    """tokens off by one: the reader refused and the rebuild it asked for did nothing; one hex digit of
    build_hash: the whole --out was declared another build. Now only that shard is redone."""
    from pathlib import Path

    root = tmp_path / "c"
    shutil.copytree(built_cache, root)
    os.remove(root / "manifest.json")
    if how == "structure":
        (root / "shards" / "shard-00001.json").write_text(
            '{"shard": 1, "file": "shards/shard-00001.safetensors"}'
        )
        (root / "shards" / "shard-00004.json").write_text("{not json")
    elif how in ("tokens", "counted"):
        _edit_sidecar(root, 1, lambda side: side.update({how: side[how] + 1}))
    else:
        _edit_sidecar(
            root, 1, lambda side: side.update(build_hash=_flip_digit(side["build_hash"], 7))
        )
    build(cache_config(teacher_dir, text_file, root))
    assert _digests(root) == _digests(Path(built_cache))
    assert TopKCache(str(root)).verify() == [] and len(TopKCache(str(root))[4]["input_ids"]) > 0


def test_teacher_path_spelling_is_the_same_build(
    built_cache, teacher_dir, text_file, tmp_path, monkeypatch
):
    root = tmp_path / "c"
    shutil.copytree(built_cache, root)
    before = (root / "manifest.json").stat().st_mtime_ns
    monkeypatch.chdir(os.path.dirname(teacher_dir))
    name = os.path.basename(teacher_dir)
    moved = str(tmp_path / "moved-teacher")
    shutil.copytree(teacher_dir, moved)
    for spelling in (f"./{name}", f"{name}/", teacher_dir, moved):
        build(cache_config(spelling, text_file, root))  # finished and verified: nothing to do
    assert (root / "manifest.json").stat().st_mtime_ns == before


def test_a_second_build_on_the_same_out_is_refused(teacher_dir, text_file, tmp_path):
    out = tmp_path / "c"
    os.makedirs(out)
    with build_lock(str(out), "0-0"):  # the first build holds the lock
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "topkd.cli",
                "cache",
                "build",
                "--teacher",
                teacher_dir,
                "--data",
                text_file,
                "--out",
                str(out),
                "--seq-len",
                "48",
                "--targets",
                "topk",
                "--k",
                "4",
            ],
            capture_output=True,
            text=True,
            env=SUBPROCESS_ENV,
        )
        assert res.returncode == 2 and f"process {os.getpid()} holds" in res.stderr, res.stderr[
            -500:
        ]
        assert not list((out / "shards").glob("*")) if (out / "shards").exists() else True
    build(cache_config(teacher_dir, text_file, out, max_sequences=2))  # released: builds


def test_stale_temp_files_of_live_processes_are_kept(teacher_dir, text_file, tmp_path):
    out = tmp_path / "c"
    os.makedirs(out / "shards")
    live = out / "shards" / f"shard-00000.safetensors.tmp-{os.getppid()}"
    dead = out / "shards" / "shard-00000.safetensors.tmp-999999999"
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    build(cache_config(teacher_dir, text_file, out, max_sequences=2))
    assert live.exists() and not dead.exists()
    assert np.isfinite(TopKCache(str(out))[0]["teacher_logprobs"].numpy()).all()


@pytest.mark.parametrize(
    "name", ["tokenizer.tmp", "tokenizer", "shards", "manifest.json", ".build-0-0.lock"]
)
def test_planted_links_never_make_the_build_write_outside_out(
    teacher_dir, text_file, tmp_path, name
):
    """A planted tokenizer.tmp link made save_pretrained write through it, and renamed the link into
    CACHE/tokenizer; the build now writes its tokenizer through a fresh private temp directory and refuses
    links at every name it writes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    out = tmp_path / "c"
    out.mkdir()
    os.symlink(outside if name != ".build-0-0.lock" else outside / "precious", out / name)
    cfg = cache_config(teacher_dir, text_file, out, max_sequences=2)
    # not a name the build writes any more: ignored, never written through
    if name == "tokenizer.tmp":
        build(cfg)
        assert (out / "tokenizer").is_dir() and not (out / "tokenizer").is_symlink()
        assert TopKCache(str(out)).check_student(1000) is None
    else:
        with pytest.raises(
            ValueError,
            match=rf"{name}: expected a file or directory this job writes, got a "
            "symbolic link",
        ):
            build(cfg)
    assert sorted(p.name for p in outside.iterdir()) == ["precious"]
    assert (outside / "precious").read_text() == "keep me"


def test_write_atomic_never_writes_through_a_planted_temp_link(tmp_path):
    from topkd.base.files import write_atomic

    target = tmp_path / "target"
    target.write_text("keep me")
    path = tmp_path / "file.json"
    os.symlink(target, f"{path}.tmp-{os.getpid()}")
    write_atomic(str(path), b"new")
    assert path.read_bytes() == b"new" and not path.is_symlink() and target.read_text() == "keep me"


def test_a_damaged_stored_tokenizer_is_reported_and_never_blames_the_student(
    cache_copy, teacher_dir
):
    """Merges dropped from CACHE/tokenizer/tokenizer.json: it matched tokenizer_sha256, passed verify, and the
    correct student was refused with a message blaming the student. The manifest now records every file."""
    from transformers import AutoTokenizer

    _drop_merges(os.path.join(cache_copy, "tokenizer", "tokenizer.json"))
    cache = TopKCache(cache_copy)
    assert cache.verify() == [
        "tokenizer/tokenizer.json: size or sha256 differs from the build's (edited or damaged)"
    ]
    with pytest.raises(
        CacheError, match="its stored teacher tokenizer is damaged .*rerun the build command"
    ):
        cache.check_student(1000, AutoTokenizer.from_pretrained(teacher_dir))
    res = subprocess.run(
        [sys.executable, "-m", "topkd.cli", "cache", "verify", cache_copy],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
    )
    assert res.returncode != 0 and "tokenizer/tokenizer.json" in res.stdout + res.stderr


def _flip_digit(digest: str, i: int) -> str:
    """The hex digest with its i-th digit changed (0 <-> 1 or anything -> 0): a different, well-formed digest."""
    return ("1" if digest[i] == "0" else "0").join((digest[:i], digest[i + 1 :]))
