"""Student compatibility judged on what matters: ids for the same text, the special tokens the data uses, a head
large enough for the ids the cache holds (Qwen-style padded teacher vocabularies); first differing token shown."""

import json
import os

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from topkd.cache import TopKCache
from topkd.cache.building.compat import check_student_fits, tokenizer_mismatch


def _swapped(tok, a: str, b: str):
    """The tokenizer with two vocabulary entries' ids exchanged: same files' shape, different ids."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=tok.eos_token
    )


def test_added_tokens_and_padded_heads_are_accepted(built_cache, teacher_dir):
    cache = TopKCache(built_cache)
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    cache.check_student(vocab_size=1000, tokenizer=tok)
    # a padded lm_head: rows beyond the teacher's are never targets
    cache.check_student(vocab_size=1128)
    # a student with its own added tokens past the teacher's ids
    tok.add_tokens(["<extra>", "<|im_start|>"])
    cache.check_student(vocab_size=1002, tokenizer=tok)
    # the cache keeps the teacher's tokenizer
    assert os.path.isdir(os.path.join(cache.path, "tokenizer"))


def test_a_smaller_head_fits_when_every_cached_id_is_below_it(built_cache):
    cache = TopKCache(built_cache)
    largest = cache.max_id
    assert largest is not None and largest < cache.vocab_size
    cache.check_student(vocab_size=largest + 1)  # like Qwen2.5 7B (152,064 rows) -> 3B (151,936)
    with pytest.raises(
        ValueError,
        match=rf"more than every id the cache holds \(largest: {largest}\), got {largest}",
    ):
        cache.check_student(vocab_size=largest)
    with pytest.raises(ValueError, match=r"largest: unknown .* or rebuild the cache"):
        check_student_fits(1000, "x", 999, max_id=None)


def test_a_real_mismatch_names_the_first_differing_token(built_cache, teacher_dir):
    teacher = AutoTokenizer.from_pretrained(teacher_dir)
    ids = sorted(teacher.get_vocab().items(), key=lambda kv: kv[1])
    a, b = ids[300][0], ids[301][0]
    student = _swapped(teacher, a, b)
    assert tokenizer_mismatch(teacher, teacher) is None
    assert (
        tokenizer_mismatch(teacher, student)
        == f"token {a!r} is id 300 for the teacher and id 301 for the student"
    )
    with pytest.raises(
        ValueError,
        match=rf"student tokenizer: expected the teacher's token ids, got different ones: "
        rf"token {a!r} is id 300",
    ):
        TopKCache(built_cache).check_student(vocab_size=1000, tokenizer=student)


def test_without_the_teachers_tokenizer_only_the_hash_is_compared(teacher_dir):
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    tok.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="does not keep the teacher's tokenizer"):
        check_student_fits(1000, "0" * 64, 1001, tok, teacher_tokenizer=None)
