"""--engine vllm without vLLM: its conversion on vLLM-shaped outputs, and a whole build against the HF engine.

The stand-in `vllm` module answers generate() the way vLLM does (prompt_logprobs: None first, then
{token id: Logprob(logprob, rank)} with the top-K plus the actual token when it ranks below K; one
greedy generated token with its top-K), computed from the tiny HF teacher. So a cache built through
it must hold the HF engine's rows: same ids in rank order, same log-probs, tail from 1 - mass.
"""

import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.conftest import cache_config
from topkd.cache import TopKCache, build
from topkd.cache.building.teacher import load_teacher
from topkd.cache.building.vllm_engine import document_pieces, rows_from_prompt


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


def vllm_entry(logp: torch.Tensor, k: int, actual: int | None) -> dict:
    """One position as vLLM reports it: the top-K, plus the actual token with its rank if outside them."""
    order = logp.argsort(descending=True)
    entry = {int(t): Logprob(float(logp[t]), r + 1) for r, t in enumerate(order[:k])}
    if actual is not None and actual not in entry:
        entry[actual] = Logprob(float(logp[actual]), int((order == actual).nonzero()) + 1)
    return entry


class RecordedLLM:
    """vllm.LLM stand-in backed by the HF teacher; keeps its constructor arguments and the prompts."""

    instances: list = []

    def __init__(self, model: str, **kwargs):
        self.kwargs, self.prompts = kwargs, []
        self.teacher = load_teacher(model)
        RecordedLLM.instances.append(self)

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        k, out = params.kwargs["prompt_logprobs"], []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            self.prompts.append(ids)
            logp = torch.log_softmax(self.teacher.model(torch.tensor([ids])).logits[0].float(), -1)
            prompt_logprobs = [None] + [
                vllm_entry(logp[t - 1], k, ids[t]) for t in range(1, len(ids))
            ]
            # greedy: always inside the top-K
            generated = vllm_entry(logp[-1], k, int(logp[-1].argmax()))
            out.append(
                types.SimpleNamespace(
                    prompt_token_ids=ids,
                    prompt_logprobs=prompt_logprobs,
                    outputs=[types.SimpleNamespace(logprobs=[generated])],
                )
            )
        return out


class RecordedSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = (
        RecordedLLM,
        RecordedSamplingParams,
        "recorded",
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    RecordedLLM.instances = []
    return module


def test_conversion_drops_the_extra_entry_and_shifts_rows_by_one():

    def lp(*entries: tuple) -> dict:
        return {t: Logprob(v, r) for t, v, r in entries}

    prompt = [5, 9, 2]
    recorded = [None, lp((9, -0.1, 1), (3, -2.5, 2)), lp((7, -0.3, 1), (4, -1.5, 2), (2, -6.0, 9))]
    after = lp((4, -0.2, 1), (1, -1.9, 2))
    rows = rows_from_prompt(prompt, recorded, after, k=2)
    # row t predicts token t+1; rank 9 (actual 2) dropped
    assert rows.ids.tolist() == [[9, 3], [7, 4], [4, 1]]
    np.testing.assert_allclose(rows.logprobs, [[-0.1, -2.5], [-0.3, -1.5], [-0.2, -1.9]], rtol=1e-6)
    mass = np.log(np.exp(-0.1) + np.exp(-2.5))
    np.testing.assert_allclose(rows.log_tail[0], np.log1p(-np.exp(mass)), rtol=1e-5)
    assert rows.logz.shape == (3, 0)
    with pytest.raises(ValueError, match="starting with None"):
        rows_from_prompt(prompt, recorded[1:] + [after], after, k=2)
    with pytest.raises(ValueError, match="expected 3 entries ranked 1..3 at row 0"):
        rows_from_prompt(prompt, recorded, after, k=3)


def test_sequences_are_cut_into_one_prompt_per_document():
    pieces = document_pieces(np.arange(10), np.array([0, 4, 7]))
    assert [p.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_vllm_build_holds_the_hf_engine_rows(fake_vllm, teacher_dir, documents_file, tmp_path):
    opts = dict(temperatures=[], k=8)
    build(cache_config(teacher_dir, documents_file, tmp_path / "hf", **opts))
    build(cache_config(teacher_dir, documents_file, tmp_path / "vllm", engine="vllm", **opts))
    llm = RecordedLLM.instances[0]
    assert llm.kwargs["max_logprobs"] == 8 and llm.kwargs["enable_prefix_caching"] is False
    hf, vl = TopKCache(str(tmp_path / "hf")), TopKCache(str(tmp_path / "vllm"))
    assert vl.fingerprint["engine"] == "vllm recorded" and len(hf) == len(vl)
    # one fingerprint builder (topkd.cache.building.teacher.fingerprint)
    assert set(vl.fingerprint) == set(hf.fingerprint)
    same = (
        "tokenizer_sha256",
        "vocab_size",
        "k",
        "temperatures",
        "alignment",
        "attention",
        "teacher",
    )
    assert {key: vl.fingerprint[key] for key in same} == {key: hf.fingerprint[key] for key in same}
    # documents, not sequences
    assert sum(map(len, llm.prompts)) == vl.tokens and len(llm.prompts) > len(vl)
    for i in range(len(hf)):
        a, b = hf[i], vl[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["teacher_ids"], b["teacher_ids"]
        )
        # uint8 codes
        torch.testing.assert_close(a["teacher_logprobs"], b["teacher_logprobs"], atol=0.02, rtol=0)
        torch.testing.assert_close(a["log_tail"], b["log_tail"], atol=1e-4, rtol=1e-4)


def test_vllm_refuses_what_it_cannot_build(
    fake_vllm, teacher_dir, documents_file, tmp_path, monkeypatch
):
    with pytest.raises(ValueError, match="expected no --temperatures"):
        build(
            cache_config(
                teacher_dir, documents_file, tmp_path / "t", engine="vllm", temperatures=[2.0]
            )
        )
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="expected one process"):
        build(
            cache_config(
                teacher_dir, documents_file, tmp_path / "w", engine="vllm", temperatures=[]
            )
        )
