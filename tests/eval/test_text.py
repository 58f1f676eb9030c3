"""`topkd eval` text scoring: bits/byte against a plain forward."""

import json
import math

import pytest
import torch

from topkd.eval import evaluate_text


def test_text_bits_per_byte_matches_a_plain_forward(teacher, tmp_path):
    model, tok = teacher
    docs = [
        "to be or not to be that is the question",
        "the rest is silence and more words follow here",
    ]
    path = tmp_path / "held.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    result = evaluate_text(model, tok, [str(path)], seq_len=64)
    nll, count = 0.0, 0
    for d in docs:  # each document alone, with its closing EOS, first token unscored
        ids = tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        nll -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        count += len(ids) - 1
    text_bytes = sum(
        len(tok.decode(tok(d, add_special_tokens=False)["input_ids"]).encode()) for d in docs
    )
    assert result["scored_tokens"] == count
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / text_bytes, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
