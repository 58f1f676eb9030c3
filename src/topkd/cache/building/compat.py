"""Can this student learn from this teacher's rows? Its tokenizer and its vocabulary, judged on what matters.

    check_student_fits(teacher_vocab, teacher_tokenizer, student_vocab, student_tokenizer, max_id=cache.max_id)

Tokenizer: the student must give the same ids for the same text and the same special tokens the data uses
(EOS separates documents; BOS opens chat templates): every teacher token maps to the same id in the student,
EOS/BOS agree, and a probe text (prose, code, digits, non-Latin scripts) encodes identically. Byte-equal files
are not required, and a student with added tokens beyond the teacher's ids is accepted. A mismatch is refused
with the first differing token shown. Without the teacher's tokenizer (a cache written before caches kept
it, whose teacher directory is gone) only the vocabulary hash can be compared, as before.

Vocabulary: a student head with at least the teacher's rows (padding rows beyond it) always fits; a smaller
one fits when every id the cache holds is below its size (the build records the largest id it saw), which is
the usual Qwen-style pair whose extra teacher rows are padding the tokenizer never produces.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from topkd.base.files import refuse_links
from topkd.cache.building.teacher import tokenizer_hash
from topkd.cache.format import manifest as mf

PROBE = (
    "The quick brown fox jumps over the lazy dog. 1234567890 + 3.14159 = x;\n"
    "def f(a, b):\n    return a ** 2 - b  # comment\n"
    "Größe, naïve café, ¿qué? Привет, мир. 你好，世界。こんにちは。 안녕하세요. 🙂 <tag>&amp;</tag>"
)


def tokenizer_mismatch(teacher, student) -> str | None:
    """The first reason the student's token ids would differ from the teacher's, or None when they agree."""
    student_vocab = student.get_vocab()
    for token, tid in sorted(teacher.get_vocab().items(), key=lambda kv: kv[1]):
        sid = student_vocab.get(token)
        if sid != tid:
            student_side = "missing" if sid is None else f"id {sid}"
            return f"token {token!r} is id {tid} for the teacher and {student_side} for the student"
    for name in ("eos_token_id", "bos_token_id"):
        t, s = getattr(teacher, name, None), getattr(student, name, None)
        if t is not None and t != s:
            return f"{name.removesuffix('_id')}: teacher id {t}, student id {s}"
    t_ids = teacher(PROBE, add_special_tokens=False)["input_ids"]
    s_ids = student(PROBE, add_special_tokens=False)["input_ids"]
    for j, (a, b) in enumerate(zip(t_ids, s_ids)):
        if a != b:
            return (
                f"the probe text encodes differently at token {j}: teacher {teacher.convert_ids_to_tokens(a)!r} "
                f"(id {a}), student {student.convert_ids_to_tokens(b)!r} (id {b})"
            )
    if len(t_ids) != len(s_ids):
        return f"the probe text is {len(t_ids)} tokens for the teacher and {len(s_ids)} for the student"
    return None


def check_student_fits(
    teacher_vocab: int,
    teacher_tokenizer_sha256: str,
    vocab_size: int,
    tokenizer=None,
    teacher_tokenizer=None,
    max_id: int | None = None,
) -> None:
    """Refuse a student whose head cannot hold the cache's ids, or whose tokenizer gives other ids."""
    if vocab_size < teacher_vocab and (max_id is None or max_id >= vocab_size):
        seen = "unknown (a cache from before builds recorded it)" if max_id is None else str(max_id)
        raise ValueError(
            f"student vocabulary: expected >= the teacher's {teacher_vocab} rows, or more than every id "
            f"the cache holds (largest: {seen}), got {vocab_size}; use a student with the teacher's "
            "tokenizer and a large enough head"
            + ("" if max_id is not None else ", or rebuild the cache")
            + ", or pass --fold-beyond-vocab (train and eval) to fold the teacher's mass on the ids "
            "beyond it into the tail"
        )
    if tokenizer is None:
        return
    if teacher_tokenizer is not None:
        problem = tokenizer_mismatch(teacher_tokenizer, tokenizer)
        if problem:
            raise ValueError(
                f"student tokenizer: expected the teacher's token ids, got different ones: {problem}; "
                "use a student of the teacher's tokenizer family"
            )
    elif tokenizer_hash(tokenizer) != teacher_tokenizer_sha256:
        raise ValueError(
            f"student tokenizer: expected the teacher's (sha256 {teacher_tokenizer_sha256[:12]}), got a "
            f"different one (sha256 {tokenizer_hash(tokenizer)[:12]}); this cache does not keep the "
            "teacher's tokenizer to compare token by token (rebuild it), and its teacher directory "
            "is not reachable"
        )


TOKENIZER_DIR = "tokenizer"


def save_teacher_tokenizer(root: str, tokenizer) -> dict:
    """The teacher's tokenizer files in the cache (root/tokenizer), for the token-by-token student check; returns
    their sizes and checksums, which the manifest records (verify checks them, a rerun of the build repairs)."""
    path = os.path.join(root, TOKENIZER_DIR)
    refuse_links(root, [TOKENIZER_DIR])
    # new and private: nothing planted inside
    tmp = tempfile.mkdtemp(prefix=TOKENIZER_DIR + ".tmp-", dir=root)
    try:
        tokenizer.save_pretrained(tmp)
        sums = mf.file_sums(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sums


def tokenizer_problems(root: str, manifest: dict) -> list[str]:
    """What is wrong with the stored tokenizer against the manifest's checksums ([]: intact, or not recorded)."""
    sums = manifest.get("tokenizer_files")
    return (
        []
        if sums is None
        else mf.file_sums_problems(os.path.join(root, TOKENIZER_DIR), sums, TOKENIZER_DIR)
    )


def load_teacher_tokenizer(root: str, manifest: dict):
    """The teacher's tokenizer: the cache's copy, else the teacher directory's; only if it hashes as the
    fingerprint says (a swapped copy is ignored). A stored copy whose files differ from the checksums the
    build recorded is refused: a damaged tokenizer must not make the right student look wrong. None when
    neither is there."""
    from transformers import AutoTokenizer

    fingerprint = manifest["fingerprint"]
    problems = tokenizer_problems(root, manifest)
    if problems and os.path.exists(os.path.join(root, TOKENIZER_DIR)):
        raise mf.CacheError(
            f"cache {root}: its stored teacher tokenizer is damaged ({problems[0]}); rerun the build "
            "command to repair it (the shards are kept)"
        )
    for place in (os.path.join(root, TOKENIZER_DIR), fingerprint.get("teacher", "")):
        if place and os.path.isdir(place):
            try:
                tokenizer = AutoTokenizer.from_pretrained(place)
            except (OSError, ValueError):
                continue
            if tokenizer_hash(tokenizer) == fingerprint["tokenizer_sha256"]:
                return tokenizer
    return None
