"""Training never continues silently on damaged or mismatched state: checksummed checkpoints with fallback,
run fingerprints, NaN steps, --out that would overwrite inputs, signals that checkpoint before stopping."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.train.runs import cli_args, config, losses, wait_for_rows
from topkd.base.files import file_sha256
from topkd.train import checkpoint as ckpt
from topkd.train import train
from topkd.train.student import KDStudent

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def _flip_byte(path, offset=-20) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x40
    open(path, "wb").write(data)


def test_damaged_newest_checkpoint_falls_back_to_the_intact_one(built_cache, tmp_path, capfd):
    train(config(built_cache, tmp_path / "ref", steps=6, checkpoint_every=2))
    run = tmp_path / "run"
    train(config(built_cache, run, steps=4, checkpoint_every=2))
    newest = run / "checkpoints" / "step-000004"
    _flip_byte(next(newest.glob("*.distcp")))
    train(config(built_cache, run, steps=6, checkpoint_every=2))
    err = capfd.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and "size or sha256 differs" in err
    assert losses(run) == losses(tmp_path / "ref")  # resumed from step 2, on the same trajectory
    assert (run / "checkpoints" / "step-000004.damaged").is_dir()


def test_every_checkpoint_damaged_is_a_clear_error(built_cache, tmp_path):
    train(config(built_cache, tmp_path, steps=2, checkpoint_every=1))
    for d in (tmp_path / "checkpoints").glob("step-??????"):
        _flip_byte(d / "train_state.json", 5)
    with pytest.raises(ValueError, match="every checkpoint is damaged"):
        train(config(built_cache, tmp_path, steps=3, checkpoint_every=1))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_crafted_checkpoint_pickle_is_never_executed(built_cache, tmp_path, monkeypatch):
    train(config(built_cache, tmp_path, steps=1))
    path = tmp_path / "checkpoints" / "step-000001"
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    sums = json.load(open(path / "checksums.json"))  # the attacker fixes the checksums too
    sums[".metadata"] = {
        "bytes": (path / ".metadata").stat().st_size,
        "sha256": file_sha256(str(path / ".metadata")),
    }
    json.dump(sums, open(path / "checksums.json", "w"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="posix.system|os.system"):
        train(config(built_cache, tmp_path, steps=2))
    assert not (tmp_path / "PWNED").exists()


def test_other_flags_on_an_existing_run_are_refused_but_more_steps_are_not(built_cache, tmp_path):
    train(config(built_cache, tmp_path, steps=2))
    with pytest.raises(ValueError, match=r"--lr 0.003 -> 0.01.*only --steps"):
        train(config(built_cache, tmp_path, steps=4, lr=1e-2))
    with pytest.raises(ValueError, match="already at step 2, beyond --steps 1"):
        train(config(built_cache, tmp_path, steps=1))
    # speed flags and more steps: allowed
    train(config(built_cache, tmp_path, steps=3, loader_workers=0))
    assert len(losses(tmp_path)) == 3
    assert json.load(open(tmp_path / "config.json"))["steps"] == 3
    recorded = json.load(open(tmp_path / "run.json"))
    # as a run recorded before these flags existed
    for newer in ("lora_rank", "fold_beyond_vocab", "train_on"):
        recorded.pop(newer)
    (tmp_path / "run.json").write_text(json.dumps(recorded))
    # a setting missing from an older run counts as its default
    train(config(built_cache, tmp_path, steps=4))
    with pytest.raises(ValueError, match=r"--fold-beyond-vocab False -> True"):
        train(config(built_cache, tmp_path, steps=5, fold_beyond_vocab=True))


def test_a_resume_with_the_cache_spelled_another_way_continues(built_cache, tmp_path, monkeypatch):
    """A job script that switched to absolute paths (or a symlink) could not resume: the cache is compared by
    content (its build hash), as cache build compares its inputs; another cache is still refused."""
    import shutil

    from topkd.cache.format.manifest import build_hash
    from topkd.train.config import _same_input

    monkeypatch.chdir(os.path.dirname(built_cache))
    train(config(os.path.basename(built_cache), tmp_path, steps=2))
    os.symlink(built_cache, tmp_path / "link")
    train(config(str(tmp_path / "link"), tmp_path, steps=3))
    train(config(os.path.abspath(built_cache) + "/", tmp_path, steps=4))
    assert len(losses(tmp_path)) == 4
    other = shutil.copytree(built_cache, tmp_path / "other")
    manifest = json.load(open(other / "manifest.json"))
    manifest["build"]["seq_len"] += 1  # another build: its build hash differs
    manifest["build_hash"] = build_hash(manifest["fingerprint"], manifest["build"])
    json.dump(manifest, open(other / "manifest.json", "w"))
    link = str(tmp_path / "link")
    assert (
        _same_input("cache", str(other))
        != _same_input("cache", built_cache)
        == _same_input("cache", link)
    )


@pytest.mark.parametrize("where", ["student", "cache"])
def test_out_inside_the_student_or_the_cache_is_refused(built_cache, tmp_path, teacher_dir, where):
    import shutil

    student = shutil.copytree(teacher_dir, tmp_path / "student")
    before = (student / "config.json").read_bytes()
    out = (student if where == "student" else tmp_path / "cache") / "run"
    cache = shutil.copytree(built_cache, tmp_path / "cache")
    with pytest.raises(ValueError, match=f"is inside --{where}"):
        train(config(str(cache), out, init_from_teacher=False, student=str(student)))
    assert (student / "config.json").read_bytes() == before and not out.exists()
    with pytest.raises(ValueError, match="is inside --student"):
        train(config(str(cache), student, init_from_teacher=False, student=str(student)))


def _nan_at(step: int):
    forward = KDStudent.forward
    calls = {"n": 0}

    def patched(self, batch, monitor=None):
        calls["n"] += 1
        loss = forward(self, batch, monitor)
        return loss * float("nan") if calls["n"] == step else loss

    return patched


def test_a_nan_step_stops_the_run_and_keeps_the_last_good_checkpoint(
    built_cache, tmp_path, monkeypatch
):
    monkeypatch.setattr(KDStudent, "forward", _nan_at(3))
    with pytest.raises(
        ValueError, match=r"step 3: loss nan .* newest checkpoint \(step 2\) is intact"
    ):
        train(config(built_cache, tmp_path, steps=5, checkpoint_every=1))
    assert (
        ckpt.latest_step(str(tmp_path)) == 2
        and ckpt.damage(str(tmp_path / "checkpoints" / "step-000002")) is None
    )


def test_skip_nonfinite_skips_the_step_and_the_weights_stay_finite(
    built_cache, tmp_path, monkeypatch
):
    monkeypatch.setattr(KDStudent, "forward", _nan_at(2))
    train(config(built_cache, tmp_path, steps=4, skip_nonfinite=True))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("skipped", False) for r in rows] == [False, True, False, False]
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_metrics_rows_carry_the_epoch_and_a_multi_epoch_run_warns(built_cache, tmp_path, capfd):
    train(config(built_cache, tmp_path, steps=4, batch_size=16, warmup_steps=5))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # 37 samples per epoch; the epoch a step starts in
    assert [r["epoch"] for r in rows] == [0, 0, 0, 1]
    err = capfd.readouterr().err
    assert "epochs over the 37 samples" in err and "below --warmup-steps 5" in err


@pytest.fixture(scope="module")
def reference_losses(built_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    subprocess.run(cli_args(built_cache, out, 60), env=ENV, check=True, capture_output=True)
    return losses(out)


@pytest.mark.once
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_then_stops_and_the_rerun_continues(
    built_cache, tmp_path, signum, reference_losses
):
    steps, run = 60, tmp_path / "run"
    proc = subprocess.Popen(
        cli_args(built_cache, run, steps),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_rows(run / "metrics.jsonl", 5, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("topkd train: stopped at step") and "checkpoint saved to" in line
    stopped_at = int(line.split("step ")[1].split(";")[0])
    assert stopped_at < steps and ckpt.latest_step(str(run)) == stopped_at
    assert not list((run / "checkpoints").glob("*.tmp"))
    subprocess.run(cli_args(built_cache, run, steps), env=ENV, check=True, capture_output=True)
    assert losses(run) == reference_losses


@pytest.mark.once
def test_a_kill_during_the_metrics_rewrite_never_empties_it(tmp_path):
    """truncate_metrics rewrites the file on resume: killed at random moments, the file is old or new, never cut."""
    path = tmp_path / "metrics.jsonl"
    rows = "".join(
        json.dumps({"step": i, "loss": 1.0, "pad": "x" * 5000}) + "\n" for i in range(1, 20_001)
    )
    script = (
        "import sys; from topkd.train.checkpoint import truncate_metrics; print('ready', flush=True); "
        f"truncate_metrics({str(path)!r}, 15000)"
    )
    killed = 0
    for delay in (0.15, 0.22, 0.29, 0.36):  # parsing takes ~0.2 s, then the file is rewritten
        path.write_text(rows)
        proc = subprocess.Popen(
            [sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"  # imports done: the rewrite starts now
        time.sleep(delay)
        proc.kill()
        killed += proc.wait() == -signal.SIGKILL
        n = sum(1 for _ in open(path))
        assert n in (20_000, 15_000), f"metrics.jsonl cut to {n} rows"
    assert killed >= 2, "the rewrite finished before the kills: make the file larger"


HOLD_LOCK = (
    "import sys, time; from topkd.base.files import exclusive_lock\n"
    "with exclusive_lock(sys.argv[1], 'busy'):\n    print('held', flush=True); time.sleep(600)"
)


def test_out_is_held_before_the_student_loads(built_cache, tmp_path, monkeypatch):
    """A second run started while the first still loads its student (minutes, for a large one) used to load
    too, then either fail at the lock or, when the first had finished meanwhile, exit 0 having done nothing."""
    from topkd.train import loop

    def never(*args):
        raise AssertionError("the student loaded into an --out another run holds")

    monkeypatch.setattr(loop, "open_run", never)
    out = tmp_path / "run"
    os.makedirs(out)
    # the first run, loading: another process (a record lock is the same process's to take again)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out / ".train-0.lock")],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            ValueError, match=rf"another topkd train is running there \(process {holder.pid}"
        ):
            train(config(built_cache, out))
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setattr(
        loop, "open_run", lambda *args: (_ for _ in ()).throw(ValueError("refused"))
    )
    with pytest.raises(ValueError, match="refused"):
        train(config(built_cache, tmp_path / "new"))
    assert not (tmp_path / "new").exists()  # a refused run leaves no --out behind


def test_rerunning_a_finished_run_says_it_trained_nothing(built_cache, tmp_path):
    first = subprocess.run(
        cli_args(built_cache, tmp_path / "run", 3), env=ENV, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-2000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = subprocess.run(
        cli_args(built_cache, tmp_path / "run", 3), env=ENV, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == (
        f"topkd train: {tmp_path / 'run'} already holds this run finished at step 3 of --steps 3: nothing "
        "trained; final/ and loss.png rewritten from its checkpoint (pass a larger --steps to train on)"
    )
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    assert train(
        config(
            built_cache,
            tmp_path / "run",
            steps=3,
            warmup_steps=2,
            lr=3e-3,
            batch_size=2,
            checkpoint_every=2,
            seq_len=24,
        )
    ) == json.loads(metrics.splitlines()[-1])


@pytest.mark.once
def test_a_second_train_on_a_running_out_is_refused_and_the_first_goes_on(built_cache, tmp_path):
    """A requeued cluster job overlapping the old one: both ran to the end, interleaving metrics.jsonl,
    checkpoints and run.json. --out is now held by an exclusive lock."""
    run = tmp_path / "run"
    first = subprocess.Popen(
        cli_args(built_cache, run, 100_000),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_rows(run / "metrics.jsonl", 2, first)
    second = subprocess.run(
        cli_args(built_cache, run, 100_000), env=ENV, capture_output=True, text=True
    )
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"another topkd train is running there (process {first.pid} holds" in second.stderr
    assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
    steps = [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # one writer
