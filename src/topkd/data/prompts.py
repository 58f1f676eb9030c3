"""Prompts for on-policy distillation: every conversation cut before each of its assistant turns.

    prompts = chat_prompts(["chats.jsonl"], tokenizer, max_tokens=192)   # list of [P] int64 token ids

A conversation of the chat JSONL that `topkd cache build` takes ({"messages": [...]}) gives one prompt per
assistant turn: the turns before it, rendered with the tokenizer's chat template and its generation prompt
(the assistant header), so that the student writes that turn itself. The reply in the data is not used: the
teacher scores what the student wrote. Prompts longer than max_tokens are left out (counted in the refusal when
none is left); text records have no turn to write and are refused.
"""

from __future__ import annotations

import numpy as np

from topkd.data.chat import check_chat_tokenizer, check_messages, render
from topkd.data.documents import jsonl_records


def chat_prompts(
    paths: list[str], tokenizer, max_tokens: int = 0, messages_field: str = "messages"
) -> list[np.ndarray]:
    """The token ids of every prompt in the files, in file and turn order (max_tokens 0: no limit)."""
    check_chat_tokenizer(tokenizer)
    prompts, too_long = [], 0
    for path in paths:
        if not path.endswith(".jsonl"):
            raise ValueError(
                f"--on-policy: expected chat JSONL files (one conversation per line), got {path!r}; "
                "on-policy training writes assistant turns, which only conversations have"
            )
        for line_no, record in jsonl_records(path):
            for prompt in _record_prompts(record, tokenizer, messages_field, f"{path}:{line_no}"):
                if max_tokens and len(prompt) > max_tokens:
                    too_long += 1
                else:
                    prompts.append(prompt)
    if not prompts:
        raise ValueError(
            f"--on-policy: expected conversations with an assistant turn after at least one other turn in "
            f"{paths}, got no prompt{f' of at most {max_tokens} tokens ({too_long} longer)' if too_long else ''}"
            "; raise --max-prompt-tokens, or pass conversations with assistant replies"
        )
    return prompts


def _record_prompts(record, tokenizer, messages_field: str, where: str) -> list[np.ndarray]:
    messages = record.get(messages_field) if isinstance(record, dict) else None
    if messages is None:
        raise ValueError(
            f"{where}: expected a conversation in {messages_field!r} (on-policy training writes its "
            f"assistant turns), got {type(record).__name__} with keys "
            f"{list(record)[:5] if isinstance(record, dict) else []}; set --messages-field"
        )
    check_messages(messages, where)
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and i > 0:
            text = render(tokenizer, messages[:i], generation_prompt=True, where=where)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(np.asarray(ids, dtype=np.int64))
    return out


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn, where generation stops: the tokenizer's EOS and the special token
    the chat template closes a reply with (<|im_end|>, <|eot_id|>, <end_of_turn>), read off a rendered turn."""
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    prompt = render(tokenizer, turn[:1], generation_prompt=True)
    reply = render(tokenizer, turn)[len(prompt) :]
    special = set(tokenizer.all_special_ids)
    after = tokenizer(reply[reply.find("ok") + 2 :], add_special_tokens=False)["input_ids"]
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += [i for i in after if i in special][:1]
    if not ids:
        raise ValueError(
            "--on-policy: expected a tokenizer with an EOS token or a chat template that ends a reply with a "
            "special token, got neither, so generation could not stop; pass --chat-template FILE"
        )
    return sorted(set(ids))
