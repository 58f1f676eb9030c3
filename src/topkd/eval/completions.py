"""What on-policy distillation optimises, measured: the teacher's reverse KL on the model's own completions.

    scores = evaluate_completions(model, teacher, prompts, GenerationSettings(64, 0.0), stop_ids, pad_id)
    # {"reverse_kl": nats per written token, "completion_len": mean tokens, "tokens": n, "examples": [...]}

The model completes each held-out prompt (topkd.data.prompts: a conversation up to an assistant turn), greedily
or sampled, and at every token it wrote the exact full-vocabulary KL(model || teacher) = sum_v q_v (log q_v -
log p_v) is taken, the model's and the teacher's next-token distributions both read over prompt + completion.
Off-policy KD fits the teacher on the data's replies; this asks how the student does on its own, which is where
exposure bias shows. [C, V] logits exist for one completion at a time (C <= --max-new-tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from topkd.models import final_hidden, model_head, soft_cap
from topkd.models.generate import GenerationSettings, generate

EXAMPLES = 3  # completions shown side by side in the report


@torch.no_grad()
def evaluate_completions(
    model,
    teacher,
    prompts: list[np.ndarray],
    settings: GenerationSettings,
    stop_ids: list[int],
    pad_id: int,
    seed: int = 0,
    batch_size: int = 8,
) -> dict:
    """Mean reverse KL per written token (and its spread over prompts), mean completion length, examples."""
    per_prompt, lengths, examples = [], [], []
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        completions = generate(model, batch, settings, seed + first, stop_ids, pad_id)
        for prompt, completion in zip(batch, completions):
            kl = completion_reverse_kl(model, teacher, prompt, completion)
            per_prompt.append(float(kl.mean()))
            lengths.append(len(completion))
            if len(examples) < EXAMPLES:
                examples.append({"prompt": prompt.tolist(), "completion": completion.tolist()})
    tokens = np.asarray(lengths, np.float64)
    weights = tokens / tokens.sum()
    return {
        "reverse_kl": float(np.dot(weights, per_prompt)),  # per written token
        "reverse_kl_prompt_std": float(np.std(per_prompt)),
        "completion_len": float(tokens.mean()),
        "tokens": int(tokens.sum()),
        "prompts": len(prompts),
        "examples": examples,
    }


def completion_reverse_kl(
    model, teacher, prompt: np.ndarray, completion: np.ndarray
) -> torch.Tensor:
    """[C] KL(model || teacher) in nats at each written token's row (the row before it), full vocabulary."""
    tokens = torch.from_numpy(np.concatenate([prompt, completion]))[None]
    rows = slice(len(prompt) - 1, len(tokens[0]) - 1)
    q = _next_token_logprobs(model, tokens, rows)
    p = _next_token_logprobs(teacher, tokens.to(next(teacher.parameters()).device), rows).to(
        q.device
    )
    vocab = min(
        q.shape[1], p.shape[1]
    )  # padding rows past the shared vocabulary hold no mass in either
    q, p = q[:, :vocab], p[:, :vocab]
    return (q.exp() * (q - p)).sum(1)


def _next_token_logprobs(model, tokens: torch.Tensor, rows: slice) -> torch.Tensor:
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    hidden = final_hidden(model, tokens, torch.arange(tokens.shape[1], device=device)[None])[
        0, rows
    ]
    weight, bias, softcap = model_head(model)
    logits = torch.nn.functional.linear(
        hidden.float(), weight.float(), None if bias is None else bias.float()
    )
    return torch.log_softmax(soft_cap(logits, softcap).double(), -1)
