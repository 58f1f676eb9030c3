"""LoRA students for `topkd train --lora-rank R` (peft, extra topkd[hf]): adapters on the body, lm_head frozen.

    topkd train --cache runs/cache --student runs/base --lora-rank 16 [--lora-alpha 32] [--lora-targets q_proj,v_proj]
                [--merge] --out runs/lora

Only the adapters train: the base weights and the lm_head are frozen, so the loss skips its dW GEMM
(4NVH instead of 6NVH per step). final/adapter/ holds the adapters (PEFT format) and the tokenizer; a
student cut from the teacher also gets its base weights in final/base/ (load it, then the adapter);
--merge writes the merged model to final/ itself, a plain model directory that `topkd eval` reads.
"""

from __future__ import annotations

import os

from torch import nn


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError(
            "--lora-rank: expected the peft package, got none installed; pip install 'topkd[hf]' "
            "(peft==0.21.2), or train without --lora-rank"
        ) from None


def add_adapters(model: nn.Module, rank: int, alpha: float, targets: list[str]) -> nn.Module:
    """model wrapped by PEFT with LoRA adapters of this rank; every other weight (lm_head included) frozen."""
    import peft

    # all-linear: every Linear but the output layer
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        lora_dropout=0.0,
        target_modules=targets or "all-linear",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:  # peft names the module it could not find
        raise ValueError(
            f"--lora-targets {','.join(targets) or 'all-linear'}: {e}; name the student's Linear "
            "modules (e.g. q_proj,k_proj,v_proj,o_proj)"
        ) from None


def save_lora_student(
    model: nn.Module, tokenizer, path: str, merge: bool, base_dir: str | None
) -> None:
    """final/adapter (adapters + tokenizer), and final/base when the base exists nowhere else; with merge, the
    merged model in final/ itself."""
    adapter = os.path.join(path, "adapter")
    base = base_dir or (None if merge else os.path.join(path, "base"))
    # adapter_config.json names its base as an absolute path, not as the path typed
    if base is not None:
        for config in model.peft_config.values():
            config.base_model_name_or_path = os.path.abspath(base)
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    if base_dir is None and not merge:
        base = os.path.join(path, "base")
        model.get_base_model().save_pretrained(base, state_dict=_base_weights(model))
        tokenizer.save_pretrained(base)
    if merge:
        # the run is over: folding the adapters into the weights is final
        merged = model.merge_and_unload()
        merged.save_pretrained(path)
        tokenizer.save_pretrained(path)


def _base_weights(model: nn.Module) -> dict:
    """The base model's own weights (the LoRA layers' base_layer tensors under their original names)."""
    out = {}
    for name, tensor in model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    return out
