"""`topkd train --teacher-url`: a run whose teacher answers over HTTP (tests/cache/served_server.py, vLLM's shape)
trains as the teacher in memory does; a server that dies mid-run stops it with one line and its last checkpoint,
and a rerun against a restarted server (on another port) resumes bit-identically; what a server cannot give is
refused before anything loads."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cache import served_server
from tests.train.runs import wait_for_rows
from topkd.train import TrainConfig, train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
SCHEDULE = dict(steps=4, batch_size=2, lr=3e-3, warmup_steps=1, checkpoint_every=0, seq_len=96)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def config(student, chats_file, out, **kw) -> TrainConfig:
    opts = {"on_policy": True, "max_new_tokens": 12, "divergence": "reverse_kl", "online_k": 16}
    return TrainConfig(student=student, data=[chats_file], out=str(out), **SCHEDULE, **opts, **kw)


@pytest.mark.parametrize(
    "grad_accum", [1, 2]
)  # 2: the server scores one micro-batch while the next is written
def test_a_run_through_the_server_trains_as_the_teacher_in_memory(
    chat_teacher_dir, chats_file, tmp_path, grad_accum
):
    server, url = served_server.start(chat_teacher_dir, cap=16, delay=0.2 * (grad_accum - 1))
    try:
        train(
            config(
                chat_teacher_dir,
                chats_file,
                tmp_path / "served",
                teacher_url=url,
                grad_accum=grad_accum,
            )
        )
    finally:
        served_server.stop(server)
    memory = config(chat_teacher_dir, chats_file, tmp_path / "memory", teacher=chat_teacher_dir)
    memory.grad_accum = grad_accum
    train(memory)
    served, memory = rows(tmp_path / "served"), rows(tmp_path / "memory")
    assert [r["generated_tokens"] for r in served] == [r["generated_tokens"] for r in memory]
    for a, b in zip(served, memory):  # the tail is 1 - kept mass there, summed here: equal to ~1e-5
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-5)


def _start_server(teacher, port_file):
    if os.path.exists(port_file):
        os.remove(port_file)
    cmd = [sys.executable, "-m", "tests.cache.served_server", teacher, port_file, "--cap", "16"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not os.path.exists(port_file):
        assert proc.poll() is None and time.time() < deadline, "the test server did not start"
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{open(port_file).read()}/v1"


def _cli(student, chats_file, out, url):
    cmd = [
        sys.executable,
        "-m",
        "topkd.cli",
        "train",
        "--on-policy",
        "--teacher-url",
        url,
        "--student",
        student,
    ]
    cmd += [
        "--data",
        chats_file,
        "--online-k",
        "16",
        "--divergence",
        "reverse_kl",
        "--max-new-tokens",
        "12",
    ]
    cmd += [
        "--seq-len",
        "96",
        "--steps",
        "24",
        "--batch-size",
        "2",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "1",
    ]
    return cmd + ["--checkpoint-every", "2", "--teacher-timeout", "20", "--out", str(out)]


@pytest.mark.once
def test_a_server_that_dies_stops_the_run_which_resumes_against_a_new_one(
    chat_teacher_dir, chats_file, tmp_path
):
    port_file = str(tmp_path / "port")
    server, url = _start_server(chat_teacher_dir, port_file)
    try:
        ref = subprocess.run(
            _cli(chat_teacher_dir, chats_file, tmp_path / "ref", url), env=ENV, capture_output=True
        )
        assert ref.returncode == 0, ref.stderr.decode()[-2000:]
        run = subprocess.Popen(
            _cli(chat_teacher_dir, chats_file, tmp_path / "cut", url),
            env=ENV,
            stderr=subprocess.PIPE,
        )
        wait_for_rows(tmp_path / "cut" / "metrics.jsonl", 5, run)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    _, err = run.communicate(timeout=120)
    lines = [line for line in err.decode().splitlines() if "teacher server" in line]
    assert run.returncode != 0 and len(lines) == 1, err.decode()[-2000:]
    assert f"teacher server {url}: could not reach /v1/completions" in lines[0]
    assert os.listdir(tmp_path / "cut" / "checkpoints"), "the last checkpoint is kept"
    assert len(rows(tmp_path / "cut")) < 24
    server, url = _start_server(chat_teacher_dir, port_file)  # restarted: another port
    try:
        again = subprocess.run(
            _cli(chat_teacher_dir, chats_file, tmp_path / "cut", url), env=ENV, capture_output=True
        )
        assert again.returncode == 0, again.stderr.decode()[-2000:]
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    keys = ("step", "loss", "grad_norm", "generated_tokens", "tokens")
    assert [[r[k] for k in keys] for r in rows(tmp_path / "cut")] == [
        [r[k] for k in keys] for r in rows(tmp_path / "ref")
    ]


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"teacher": "x"}, "--teacher-url http://h/v1: expected no --teacher"),
        ({"online_k": 0}, "--online-k >= 1"),
        ({"init_from_teacher": True, "layers": 1, "student": ""}, "no --init-from-teacher"),
        ({"temperature": 2.0}, "returns no c_T"),
    ],
)
def test_what_a_server_cannot_give_is_refused_before_anything_trains(
    chat_teacher_dir, chats_file, tmp_path, kw, words
):
    cfg = config(chat_teacher_dir, chats_file, tmp_path / "run", teacher_url="http://h/v1")
    for key, value in kw.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=words):
        train(cfg)
    with pytest.raises(ValueError, match="expected an http"):
        train(config(chat_teacher_dir, chats_file, tmp_path / "run", teacher_url="localhost:8000"))
