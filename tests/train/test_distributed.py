"""FSDP2 under torchrun (2 CPU processes, gloo) against one plain process on the same global batch.

One process with --batch-size 2 and two processes with --batch-size 1 see the same samples per
step, so their losses, gradient norms and weights must agree to float32 reduction-order noise.
A two-process distributed checkpoint is then resumed by one process (DCP reshards) and must
continue the single-process trajectory.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from topkd.train import TrainConfig, train

ARGS = dict(
    init_from_teacher=True,
    layers=2,
    grad_accum=2,
    seq_len=20,
    lr=3e-3,
    warmup_steps=1,
    clip=0.5,
    checkpoint_every=2,
    ce_weight=0.3,
    seed=3,
)


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def weights(out):
    return load_file(os.path.join(out, "final", "model.safetensors"))


def torchrun(cache, out, steps, batch_size):
    flags = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
        for k, v in ARGS.items()
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "topkd.cli",
        "train",
        "--cache",
        cache,
        "--out",
        str(out),
        f"--steps={steps}",
        f"--batch-size={batch_size}",
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.once
def test_two_fsdp_processes_match_one_and_resume_in_one(built_cache, tmp_path):
    train(TrainConfig(cache=built_cache, out=str(tmp_path / "one"), steps=4, batch_size=2, **ARGS))
    torchrun(built_cache, tmp_path / "two", steps=4, batch_size=1)
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert json.load(open(tmp_path / "two" / "config.json"))["world_size"] == 2
    for name in ("loss", "grad_norm", "tokens", "lr"):
        assert [r[name] for r in two] == pytest.approx([r[name] for r in one], rel=1e-5), name
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"))
    # lose the last checkpoint, resume the 2-process one of step 2 in one process: DCP reshards it
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step-000004")
    train(TrainConfig(cache=built_cache, out=str(tmp_path / "two"), steps=4, batch_size=2, **ARGS))
    resumed = rows(tmp_path / "two")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name, t in a.items():
        torch.testing.assert_close(b[name], t, rtol=1e-4, atol=1e-5, msg=name)
