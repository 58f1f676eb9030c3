"""Causal LMs as topkd uses them: loaded from local files only, run to their final hidden states, their head.

    model, tokenizer = load_causal_lm("path/to/model_dir", role="teacher")   # or a .gguf file; never a hub
    hidden = final_hidden(model, input_ids, position_ids)                  # [B, L, H]: the body, no logits
    weight, bias, softcap = model_head(model)                              # what every projection needs

One home for what the cache build (the teacher), training (the student) and evaluation (any model) all
do with a model. final_hidden runs under whatever grad mode the caller chose.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor


def load_causal_lm(source: str, dtype: str = "float32", device: str = "cpu", role: str = "model"):
    """(model in eval mode, tokenizer) from a local directory, or a GGUF file (dequantised by transformers);
    a missing path or tokenizer is one clear error naming `role` (teacher, student, model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(source):
        raise ValueError(f"{role}: expected a local model directory or .gguf file, got {source!r} (not found); "
                         "download the model first, topkd never fetches from a hub")
    kwargs = {"dtype": getattr(torch, dtype)}
    where = source
    if source.endswith(".gguf"):
        where, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(source)), os.path.basename(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{role} {source!r}: expected tokenizer files beside the model (tokenizer.json or "
                         f"tokenizer_config.json), got none usable ({str(e).splitlines()[0][:160]}); save the "
                         "teacher's tokenizer there with tokenizer.save_pretrained") from None
    model = AutoModelForCausalLM.from_pretrained(where, **kwargs).to(device).eval()
    return model, tokenizer


def final_hidden(model, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
    """[B, L] -> [B, L, H] final (normed) hidden states of the decoder body: no logits. position_ids that
    restart at document starts make transformers mask attention per document."""
    return model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state


def model_head(model) -> tuple[Tensor, Tensor | None, float | None]:
    """(lm_head weight, bias or None, final_logit_softcapping or None)."""
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None), getattr(model.config, "final_logit_softcapping", None) or None
