"""Tiny random teachers and text for cache tests: a byte-level BPE tokenizer trained here, a small Llama."""

from __future__ import annotations

import os

import torch

WORDS = (
    "the of and to in is was that for on with as by at from his her they this which but not are have "
    "king queen lord love night day sword crown blood heart death life speak hear sweet fair good "
).split()


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


def make_teacher(
    path: str,
    vocab: int = 1000,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    head_scale: float = 40.0,
    eos: str = "<eos>",
) -> str:
    """Save a random LlamaForCausalLM + BPE tokenizer (trained on make_text) to `path`; another vocab size or eos
    makes a student of another tokenizer (the merges differ)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        [make_text(5000, s) for s in range(4)] + [w * 3 for w in WORDS], trainer
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # a peaked, teacher-like output distribution instead of a near-uniform one
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


def make_gguf_teacher(teacher_dir: str, path: str) -> str:
    """The tiny teacher written as a GGUF file (F32 tensors, llama.cpp's names and its q/k row order, the BPE
    tokenizer and a ChatML template in the metadata), as llama.cpp's converter writes one: what users pass."""
    import json

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    cfg, tok = model.config, json.load(open(os.path.join(teacher_dir, "tokenizer.json")))
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (
        ("block_count", cfg.num_hidden_layers),
        ("context_length", cfg.max_position_embeddings),
        ("embedding_length", cfg.hidden_size),
        ("feed_forward_length", cfg.intermediate_size),
        ("attention.head_count", cfg.num_attention_heads),
        ("vocab_size", cfg.vocab_size),
        ("attention.head_count_kv", cfg.num_key_value_heads),
        ("rope.dimension_count", cfg.hidden_size // cfg.num_attention_heads),
    ):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
    writer.add_array("tokenizer.ggml.token_type", [3 if i in special else 1 for _, i in vocab])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    writer.add_uint32("tokenizer.ggml.bos_token_id", cfg.eos_token_id)
    writer.add_string("tokenizer.chat_template", CHATML)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    parts = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, t in model.state_dict().items():
        stem = name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            stem = f"blk.{i}.{parts[rest]}"
        else:
            stem = names[stem]
        w = t.detach().float().numpy()
        # llama.cpp's rotary row order (transformers undoes it)
        if stem.endswith(("attn_q", "attn_k")):
            n = heads if stem.endswith("attn_q") else kv_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(f"{stem}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
