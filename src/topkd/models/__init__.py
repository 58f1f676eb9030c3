"""Causal LMs as topkd uses them: loaded from local files only, run to their final hidden states, their head.

    model, tokenizer = load_causal_lm("path/to/model_dir", role="teacher")   # or a .gguf file; never a hub
    hidden = final_hidden(model, input_ids, position_ids)                  # [B, L, H]: the body, no logits
    weight, bias, softcap = model_head(model)                              # what every projection needs

One home for what the cache build (the teacher), training (the student) and evaluation (any model) all
do with a model (topkd.models.generate: a model's completions of prompts, for on-policy training and eval).
final_hidden runs under whatever grad mode the caller chose.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


def load_causal_lm(source: str, dtype: str = "float32", device: str = "cpu", role: str = "model"):
    """(model in eval mode, tokenizer) from a local directory, or a GGUF file (dequantised by transformers);
    a missing path or tokenizer is one clear error naming `role` (teacher, student, model)."""
    from transformers import AutoModelForCausalLM

    if not os.path.exists(source):
        raise ValueError(
            f"{role}: expected a local model directory or .gguf file, got {source!r} (not found); "
            "download the model first, topkd never fetches from a hub"
        )
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(_not_a_model(source, role))
    kwargs = {"dtype": getattr(torch, dtype)}
    where = source
    if source.endswith(".gguf"):
        where, kwargs["gguf_file"] = (
            os.path.dirname(os.path.abspath(source)),
            os.path.basename(source),
        )
    tokenizer = load_tokenizer(source, role)
    model = AutoModelForCausalLM.from_pretrained(where, **kwargs).to(device).eval()
    quantizer = getattr(model, "hf_quantizer", None)
    if "gguf_file" in kwargs and quantizer is not None:
        # a GGUF file is dequantised on load, yet the model stays marked quantized, which refuses .float() and
        # .to(dtype) and writes a GGUF quantization_config into every model saved from it: its weights are plain
        # tensors, so the marks go (as transformers' own remove_quantization_config does)
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def load_tokenizer(source: str, role: str = "model"):
    """The tokenizer of a local model directory or GGUF file, or one clear error naming `role`."""
    from transformers import AutoTokenizer

    gguf = {"gguf_file": os.path.basename(source)} if source.endswith(".gguf") else {}
    where = os.path.dirname(os.path.abspath(source)) if gguf else source
    try:
        return AutoTokenizer.from_pretrained(where, **gguf)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"{role} {source!r}: expected tokenizer files beside the model (tokenizer.json or "
            f"tokenizer_config.json), got none usable ({str(e).splitlines()[0][:160]}); save the "
            "teacher's tokenizer there with tokenizer.save_pretrained"
        ) from None


def model_positions(source: str) -> int | None:
    """The positions a model was made for (max_position_embeddings), read from its config.json or GGUF header
    without loading a weight, so --seq-len is checked in a second, not after a minute of loading; None when
    the files do not say."""
    try:
        if source.endswith(".gguf"):
            import gguf

            fields = gguf.GGUFReader(source).fields
            arch = bytes(fields["general.architecture"].parts[-1]).decode()
            value = fields.get(f"{arch}.context_length")
            return None if value is None else int(value.parts[-1][0])
        import json

        with open(os.path.join(source, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
        return value if isinstance(value, int) else None
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _not_a_model(source: str, role: str) -> str:
    """What a directory without config.json is, and what to pass instead."""
    if os.path.isdir(os.path.join(source, "adapter")):  # topkd train --lora-rank without --merge
        base = os.path.join(source, "base")
        where = (
            f"the base model in {base}"
            if os.path.isdir(base)
            else "the base model the run started from"
        )
        return (
            f"{role} {source!r}: expected a model directory (config.json), got LoRA adapters ({source}/adapter, "
            f"PEFT format) for {where}; rerun the same topkd train command with --merge (it resumes at the last "
            "step and writes the merged model there), or merge them with peft (PeftModel.from_pretrained(base, "
            "adapter).merge_and_unload())"
        )
    return (
        f"{role} {source!r}: expected a model directory with config.json (save_pretrained), got a directory "
        "without one; pass the directory that holds the model's config.json and weights"
    )


def final_hidden(model, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
    """[B, L] -> [B, L, H] final (normed) hidden states of the decoder body: no logits. position_ids that
    restart at document starts make transformers mask attention per document."""
    return model.get_decoder()(
        input_ids=input_ids, position_ids=position_ids, use_cache=False
    ).last_hidden_state


def model_head(model) -> tuple[Tensor, Tensor | None, float | None]:
    """(lm_head weight, bias or None, final_logit_softcapping or None)."""
    head = model.get_output_embeddings()
    return (
        head.weight,
        getattr(head, "bias", None),
        getattr(model.config, "final_logit_softcapping", None) or None,
    )


def soft_cap(z: Tensor, softcap: float | None) -> Tensor:
    """Gemma-2 style final logit soft-capping, in place: z <- softcap tanh(z / softcap) (no-op for None). The
    loss has its own variant (topkd/loss/fused.py) that keeps tanh for the gradient."""
    if softcap:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def logit_chunks(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None, chunk_bytes: int
):
    """(start row, fp32 logits [rows, V]) over row chunks of hidden [N, H], capped like the model's own; the
    buffer is reused between chunks (no page faults per chunk), so a caller must be done with one before the
    next. [N, V] never exists."""
    vocab = weight.shape[0]
    rows = max(1, min(hidden.shape[0], chunk_bytes // (4 * vocab)))
    buf = torch.empty(rows, vocab, device=hidden.device)
    w = weight if weight.dtype == torch.float32 else weight.float()
    b = None if bias is None else bias.float()
    for a in range(0, hidden.shape[0], rows):
        z = buf[: min(rows, hidden.shape[0] - a)]
        torch.mm(hidden[a : a + rows].float(), w.t(), out=z)
        if b is not None:
            z.add_(b)
        yield a, soft_cap(z, softcap)
