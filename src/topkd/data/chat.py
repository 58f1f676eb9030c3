"""Chat conversations -> token ids and which tokens are training targets (assistant turns only, or all).

    doc = chat_document(messages, tokenizer, train_on="assistant")   # ChatDocument(tokens, targets)

A conversation is a list of {"role", "content"} messages (the OpenAI / Hugging Face shape), rendered
with the tokenizer's chat template (or one given as a Jinja file) into one document. With
train_on="assistant" a token is a target when it lies in an assistant turn's text as the template
renders it: the reply and its end-of-turn token (e.g. <|im_end|>), not the role header the template
adds before it, nor the whitespace after the end of the turn. The teacher still reads the whole
conversation as context; only which rows count changes. Spans are found by rendering prefixes of the
conversation (the text up to the assistant's header, then up to the end of its turn), so the template must
render a conversation's prefix as a prefix of the whole; one that rewrites earlier turns is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from topkd.data.spans import owned_lengths

TRAIN_ON = ("assistant", "all")


def check_train_on(train_on: str) -> None:
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on: expected one of {TRAIN_ON}, got {train_on!r}")


@dataclass
class ChatDocument:
    tokens: np.ndarray  # [L] int64
    targets: np.ndarray  # [L] bool: this token is a training target (its preceding row counts)
    text: str | None = None  # the rendered conversation
    char_len: np.ndarray | None = (
        None  # [L] int64: characters of text each token owns (topkd.data.spans)
    )


def check_messages(messages, where: str) -> None:
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise ValueError(
            f'{where}: expected a non-empty list of {{"role": str, "content": str}} messages, got '
            f"{str(messages)[:80]!r}; set --messages-field, or use text data"
        )
    for i, m in enumerate(messages):
        check_text(m["content"], where, f"message {i} content")


def check_text(text: str, where: str, what: str) -> None:
    """JSON can spell a lone surrogate (a broken "\\ud83d" escape) that is no text a tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: {what}: expected text, got a lone surrogate {text[e.start : e.end]!r} at character "
            f"{e.start} (half of a broken \\uXXXX escape pair); repair or drop that record"
        ) from None


TEMPLATE_REMEDY = {
    "TemplateSyntaxError": "the template is not valid Jinja; fix it, or pass --chat-template FILE",
    "UndefinedError": "the template uses a name this conversation does not give it; fix the template "
    "(--chat-template FILE) or the record",
    "TemplateError": "the template refuses this conversation (e.g. roles must alternate "
    "user/assistant, or a system turn is not allowed); fix the record, or pass "
    "--chat-template FILE",
}


def render(
    tokenizer, messages: list[dict], generation_prompt: bool = False, where: str = "chat"
) -> str:
    """The conversation as the chat template renders it; a Jinja error is one line naming the record."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except TemplateError as e:
        kind = type(e).__name__
        remedy = TEMPLATE_REMEDY.get(kind, TEMPLATE_REMEDY["TemplateError"])
        raise ValueError(f"{where}: the chat template failed ({kind}: {e}); {remedy}") from None


def assistant_spans(
    tokenizer, messages: list[dict], text: str, where: str
) -> list[tuple[int, int]]:
    """Character spans [a, e) of the assistant turns in the rendered text (reply + end-of-turn token)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = render(tokenizer, messages[: i + 1], where=where)
        before = (
            render(tokenizer, messages[:i], True, where)
            if i
            else _before_first_reply(through, message, where)
        )
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"{where}: the chat template renders turn {i} differently inside the whole conversation "
                "(it rewrites earlier turns), so assistant tokens cannot be located; pass "
                "--chat-template with a prefix-stable template, or --train-on all"
            )
        spans.append((len(before), len(through.rstrip())))
    return spans


def _before_first_reply(through: str, message: dict, where: str) -> str:
    """An opening assistant turn has no earlier conversation to render with a generation prompt (templates refuse
    an empty one): its reply starts where its content does in the rendered turn."""
    at = through.rfind(message["content"]) if message["content"] else -1
    if at < 0:
        raise ValueError(
            f"{where}: the conversation opens with an assistant turn whose text the chat template does "
            "not render as given, so its tokens cannot be located; start it with a user (or system) "
            "turn, or pass --train-on all"
        )
    return through[:at]


def chat_document(
    messages: list[dict], tokenizer, train_on: str = "assistant", where: str = "chat"
) -> ChatDocument:
    check_messages(messages, where)
    check_chat_tokenizer(tokenizer)
    text = render(tokenizer, messages, where=where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = np.asarray(encoded["input_ids"], dtype=np.int64)
    char_len = owned_lengths(encoded["offset_mapping"], len(text))
    if train_on == "all":
        return ChatDocument(tokens, np.ones(len(tokens), dtype=bool), text, char_len)
    starts = np.asarray([a for a, _ in encoded["offset_mapping"]], dtype=np.int64)
    targets = np.zeros(len(tokens), dtype=bool)
    for a, e in assistant_spans(tokenizer, messages, text, where):
        targets |= (starts >= a) & (starts < e)
    return ChatDocument(tokens, targets, text, char_len)


def check_chat_tokenizer(tokenizer, template_file: str = "") -> None:
    """A tokenizer that can render and locate chat turns: a template (its own, or --chat-template), and offsets."""
    if template_file:
        with open(template_file, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat data: expected a tokenizer with a chat template, got one without; pass "
            "--chat-template FILE (a Jinja template)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "chat data: expected a fast (Rust) tokenizer, which maps tokens to text offsets, got "
            f"{type(tokenizer).__name__}; save the teacher with its tokenizer.json"
        )
