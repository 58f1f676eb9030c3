"""Tiny random teachers and text for cache tests: a byte-level BPE tokenizer trained here, a small Llama."""
from __future__ import annotations

import os

import torch

WORDS = ("the of and to in is was that for on with as by at from his her they this which but not are have "
         "king queen lord love night day sword crown blood heart death life speak hear sweet fair good ").split()


def make_text(n_words: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (n_words,), generator=g).tolist()
    lines, line = [], []
    for i, p in enumerate(picks):
        line.append(WORDS[p])
        if i % 11 == 10:
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    return "\n".join(lines + [" ".join(line)]) + "\n"


def make_teacher(path: str, vocab: int = 1000, hidden: int = 32, layers: int = 2, seed: int = 0,
                 head_scale: float = 40.0) -> str:
    """Save a random LlamaForCausalLM + BPE tokenizer (trained on make_text) to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([make_text(5000, s) for s in range(4)] + [w * 3 for w in WORDS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a peaked, teacher-like output distribution instead of a near-uniform one
        model.lm_head.weight.mul_(head_scale)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_teacher(teacher_dir: str, path: str) -> str:
    """The tiny teacher with ChatML's two special tokens added (embedding rows grown to match) and a template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
