"""On-policy prompts: a conversation cut before each assistant turn, rendered with the generation prompt; the
end-of-turn ids generation stops at; refusals of data without turns to write."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from topkd.data.prompts import chat_prompts, end_of_turn_ids

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the cat"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "a dog"},
]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_each_assistant_turn_gives_the_prompt_before_it(chat_teacher_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(chat_teacher_dir)
    data = _write(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    prompts = chat_prompts([data], tok)
    # by hand: ChatML up to each reply, ending in the assistant header the student writes after
    texts = [
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"
        "<|im_start|>assistant\nthe cat<|im_end|>\n<|im_start|>user\nand then<|im_end|>\n"
        "<|im_start|>assistant\n",
    ]
    assert [tok.decode(p.tolist()) for p in prompts] == texts
    assert all(p.dtype == np.int64 for p in prompts)
    short = chat_prompts([data], tok, max_tokens=len(prompts[0]))
    assert len(short) == 1 and np.array_equal(short[0], prompts[0])


def test_generation_stops_at_eos_and_the_templates_end_of_turn(chat_teacher_dir):
    tok = AutoTokenizer.from_pretrained(chat_teacher_dir)
    assert end_of_turn_ids(tok) == sorted(
        {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    )


@pytest.mark.parametrize(
    "name,records,words",
    [
        ("t.txt", None, "expected chat JSONL files"),
        ("t.jsonl", [{"text": "a b c"}], "expected a conversation in 'messages'"),
        ("t.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}], "got no prompt"),
        (
            "t.jsonl",
            [{"messages": CONVERSATION}],
            r"got no prompt of at most 3 tokens \(2 longer\)",
        ),
    ],
)
def test_data_without_turns_to_write_is_refused(chat_teacher_dir, tmp_path, name, records, words):
    tok = AutoTokenizer.from_pretrained(chat_teacher_dir)
    path = tmp_path / name
    _write(path, records) if records else path.write_text("a b c\n")
    with pytest.raises(ValueError, match=words):
        chat_prompts([str(path)], tok, max_tokens=3 if "3 tokens" in words else 0)
