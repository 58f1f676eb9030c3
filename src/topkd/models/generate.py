"""The student writes completions of prompts: batched, left-padded, KV-cached, seeded (Hugging Face's generate).

    completions = generate(model, prompts, GenerationSettings(max_new_tokens=64, temperature=1.0), seed=7,
                           stop_ids=[2], pad_id=0)        # list of [C] int64, each ending at a stop id or the cap

The same prompts, weights and seed give the same completions (the seed is set right before sampling), so a
resumed on-policy run regenerates exactly the batches the killed one would have. The model is put in eval mode
with its KV cache on for the call and given back as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[np.ndarray],
    settings: GenerationSettings,
    seed: int,
    stop_ids: list[int],
    pad_id: int,
) -> list[np.ndarray]:
    """One completion per prompt: the tokens after it, through the first stop id (kept: the end of the turn is a
    target as in offline chat training), or max_new_tokens of them."""
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(
        prompts
    ):  # left padding: every prompt ends where generation starts
        ids[row, longest - len(prompt) :] = torch.from_numpy(prompt)
        mask[row, longest - len(prompt) :] = 1
    sample = settings.temperature > 0
    was_training, was_caching = model.training, model.config.use_cache
    model.eval()
    model.config.use_cache = True
    try:
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=settings.max_new_tokens,
            do_sample=sample,
            **(
                {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
                if sample
                else {}
            ),
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            use_cache=True,
        )
    finally:
        model.train(was_training)
        model.config.use_cache = was_caching
    return [_through_stop(row, stop_ids) for row in out[:, longest:].cpu().numpy()]


def _through_stop(tokens: np.ndarray, stop_ids: list[int]) -> np.ndarray:
    """A generated row up to and including its first stop id (what follows is padding)."""
    hits = np.flatnonzero(np.isin(tokens, stop_ids))
    return tokens[: hits[0] + 1].astype(np.int64) if len(hits) else tokens.astype(np.int64)
