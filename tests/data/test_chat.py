"""Chat conversations: rendered with the teacher's template, one conversation per document, and only the
assistant turns (with their end-of-turn token) counted, checked by hand on a tiny tokenizer with a template;
the cache records the mask (format version 3), and training, TopKDataset and eval honour it."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.cache.tiny import make_chat_teacher
from tests.conftest import cache_config
from topkd import TopKDataset
from topkd.cache import TopKCache, build
from topkd.data.chat import chat_document

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the cat"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "a dog"},
]


@pytest.fixture(scope="module")
def chat_teacher(teacher_dir, tmp_path_factory):
    return make_chat_teacher(teacher_dir, str(tmp_path_factory.mktemp("chat-teacher")))


def _targets_text(tok, doc) -> str:
    return tok.decode(doc.tokens[doc.targets].tolist(), skip_special_tokens=False)


def test_only_assistant_replies_and_their_end_of_turn_are_targets(chat_teacher):
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    doc = chat_document(CONVERSATION, tok, "assistant")
    assert tok.decode(doc.tokens.tolist()) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    # by hand: replies + end of turn
    assert _targets_text(tok, doc) == "the cat<|im_end|>a dog<|im_end|>"
    reply_tokens = [
        len(tok("the cat<|im_end|>", add_special_tokens=False)["input_ids"]),
        len(tok("a dog<|im_end|>", add_special_tokens=False)["input_ids"]),
    ]
    assert int(doc.targets.sum()) == sum(reply_tokens)
    assert chat_document(CONVERSATION, tok, "all").targets.all()


def test_refusals_name_the_line_and_the_remedy(chat_teacher, teacher_dir):
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    with pytest.raises(ValueError, match=r"c.jsonl:3: expected a non-empty list of"):
        chat_document([{"role": "user"}], tok, where="c.jsonl:3")
    with pytest.raises(
        ValueError, match="expected a tokenizer with a chat template.*--chat-template"
    ):
        chat_document(CONVERSATION, AutoTokenizer.from_pretrained(teacher_dir))
    rewriting = AutoTokenizer.from_pretrained(chat_teacher)
    rewriting.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{{ messages|length }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="renders turn 2 differently.*--train-on all"):
        chat_document(CONVERSATION, rewriting)


def test_a_chat_cache_counts_exactly_the_assistant_tokens(chat_teacher, tmp_path):
    data = tmp_path / "chat.jsonl"
    talks = [
        CONVERSATION,
        CONVERSATION[:3],
        [
            {"role": "user", "content": "why"},
            {"role": "assistant", "content": "because the cat said so"},
        ],
    ]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in talks))
    build(cache_config(chat_teacher, str(data), tmp_path / "cache", seq_len=24, temperatures=[]))
    cache = TopKCache(str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    expected = [chat_document(m, tok) for m in talks]
    # version 6 (the conversation's text recorded) over a version-3 layout (a row mask)
    assert cache.manifest["format_version"] == 6 and cache.shard(0).meta["layout_version"] == "3"
    # the separator is no target
    assert cache.counted_tokens == sum(int(d.targets.sum()) for d in expected)
    ids = torch.cat([cache[i]["input_ids"] for i in range(len(cache))])
    counted = torch.cat([cache[i]["row_mask"] for i in range(len(cache))])
    # the tokens counted rows predict (none is predicted past the data)
    following = ids[1:][counted[:-1]]
    assert not counted[-1]
    assert tok.decode(following.tolist()) == "".join(_targets_text(tok, d) for d in expected)
    item_counts = sum(int(TopKDataset(cache, seq_len=24)[i]["kd_mask"].sum()) for i in range(3))
    assert 0 < item_counts <= cache.counted_tokens
    samples = [
        TopKDataset(cache, seq_len=24)[i] for i in range(len(TopKDataset(cache, seq_len=24)))
    ]
    assert sum(int(s["kd_mask"].sum()) for s in samples) == cache.counted_tokens
    # CE only where KD counts
    assert all(((s["labels"] >= 0) <= s["kd_mask"]).all() for s in samples)


def test_training_counts_only_assistant_tokens_online_as_offline(chat_teacher, tmp_path):
    """topkd train on the chat cache and in online mode on the same JSONL: the same counted tokens per step."""
    from tests.train.runs import config
    from topkd.train import train

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(6)))
    build(cache_config(chat_teacher, str(data), tmp_path / "cache", seq_len=24, temperatures=[]))
    train(config(str(tmp_path / "cache"), tmp_path / "offline", steps=2, seq_len=24))
    online = config(
        "",
        tmp_path / "online",
        steps=2,
        seq_len=24,
        teacher=chat_teacher,
        data=[str(data)],
        online_k=16,
    )
    train(online)
    rows = [
        [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
        for run in ("offline", "online")
    ]
    assert [r["tokens"] for r in rows[0]] == [r["tokens"] for r in rows[1]]
    counted = TopKCache(str(tmp_path / "cache")).counted_tokens
    assert (
        0 < sum(r["tokens"] for r in rows[0]) <= counted < TopKCache(str(tmp_path / "cache")).tokens
    )


def test_eval_text_scores_a_conversation_on_its_assistant_turns(chat_teacher, tmp_path):
    """topkd eval --text on chat JSONL: scored tokens are the assistant targets (their bytes too), not the rest."""
    from topkd.eval.text import evaluate_text

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    model = AutoModelForCausalLM.from_pretrained(chat_teacher)
    result = evaluate_text(model, tok, [str(data)], seq_len=64)
    doc = chat_document(CONVERSATION, tok)
    assert result["scored_tokens"] == int(doc.targets.sum())
    assert result["bytes"] == len(_targets_text(tok, doc).encode())


def test_a_rewritten_row_mask_with_fixed_checksums_is_refused(chat_teacher, tmp_path):
    """The sidecar records how many rows count: a row_mask rewritten (and the checksums fixed) no longer agrees."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from topkd.base.files import file_sha256
    from topkd.cache import CacheError

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    build(cache_config(chat_teacher, str(data), tmp_path / "cache", seq_len=64, temperatures=[]))
    root = tmp_path / "cache"
    shard = root / "shards" / "shard-00000.safetensors"
    tensors = load_file(str(shard))
    tensors["row_mask"] = np.ones_like(tensors["row_mask"])  # train on the prompts too
    save_file(tensors, str(shard))
    side_path = root / "shards" / "shard-00000.json"
    side = json.load(open(side_path))
    side.update(bytes=shard.stat().st_size, sha256=file_sha256(str(shard)))
    json.dump(side, open(side_path, "w"))
    manifest = json.load(open(root / "manifest.json"))
    manifest["shards"][0] = side
    manifest["totals"]["bytes"] = side["bytes"]
    json.dump(manifest, open(root / "manifest.json", "w"))
    cache = TopKCache(str(root))
    assert cache.verify() == [
        f"shards/shard-00000.safetensors: its row_mask counts {len(tensors['row_mask'])} "
        f"rows, the sidecar recorded {side['counted']}"
    ]
    with pytest.raises(CacheError, match="row_mask counts"):
        cache[0]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize(
    "talk, template",
    [
        ([{"role": "user", "content": "hi"}, {"role": "Assistant", "content": "the cat"}], None),
        ([{"role": "user", "content": "hi"}, {"role": "model", "content": "the cat"}], None),
        ([{"role": "user", "content": "hi"}, {"role": "user", "content": "the cat"}], None),
        (
            CONVERSATION,
            "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
            "{% endfor %}",
        ),
    ],
)
def test_chat_data_without_targets_is_refused_naming_the_roles(
    chat_teacher, tmp_path, talk, template
):
    """It built and 'trained' with 0 tokens, loss 0, exit 0."""
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": talk}] * 3)
    kw = {}
    if template:
        (tmp_path / "t.jinja").write_text(template)
        kw["chat_template"] = str(tmp_path / "t.jinja")
    with pytest.raises(
        ValueError, match="expected assistant turns to train on .*roles seen: "
    ) as refused:
        build(
            cache_config(chat_teacher, data, tmp_path / "cache", seq_len=24, temperatures=[], **kw)
        )
    assert all(f"{m['role']!r} x" in str(refused.value) for m in talk)
    assert ("renders none of their text" in str(refused.value)) == bool(template)
    assert not (tmp_path / "cache").exists()


def test_a_cache_or_step_with_no_counted_token_never_trains(
    chat_teacher, tmp_path, capfd, monkeypatch
):
    from tests.train.runs import config
    from topkd.train import loop, train

    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    build(cache_config(chat_teacher, data, tmp_path / "cache", seq_len=24, temperatures=[]))
    counts = iter([5, 0, 5])
    monkeypatch.setattr(loop, "count_tokens", lambda batch: next(counts))  # step 2: prompts only
    seen = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: seen.append(1))
    train(config(str(tmp_path / "cache"), tmp_path / "run", steps=3, seq_len=24))
    assert len(seen) == 2 and "step 2: its samples hold no counted token" in capfd.readouterr().err
    manifest = json.load(open(tmp_path / "cache" / "manifest.json"))
    for side in manifest["shards"]:
        side["counted"] = 0
    json.dump(manifest, open(tmp_path / "cache" / "manifest.json", "w"))
    with pytest.raises(ValueError, match="expected rows that count for the loss, got 0"):
        train(config(str(tmp_path / "cache"), tmp_path / "run2", steps=1, seq_len=24))


def test_a_conversation_opening_with_the_assistant_counts_its_reply(chat_teacher):
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    doc = chat_document(CONVERSATION[2:], tok)  # assistant, user, assistant
    assert _targets_text(tok, doc) == "the cat<|im_end|>a dog<|im_end|>"


@pytest.mark.parametrize(
    "template, words",
    [
        (
            "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles must alternate "
            "user/assistant') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "(TemplateError: Conversation roles must alternate user/assistant); the template refuses this conversation",
        ),
        (
            "{% for m in messages %}{{ m['content'] }{% endfor %}",
            "(TemplateSyntaxError: unexpected '}'); the template is not valid Jinja",
        ),
        (
            "{% for m in messages %}{{ m['content'] + foo.bar }}{% endfor %}",
            "(UndefinedError: 'foo' is undefined)",
        ),
    ],
)
def test_chat_template_errors_name_the_record(chat_teacher, template, words):
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    tok.chat_template = template
    with pytest.raises(ValueError) as refused:
        chat_document(CONVERSATION[2:], tok, where="c.jsonl:7")
    assert str(refused.value).startswith("c.jsonl:7: the chat template failed ") and words in str(
        refused.value
    )


@pytest.mark.parametrize(
    "record, words",
    [
        (
            '{"messages": [{"role": "user", "content": "hi \\ud83d"}]}',
            "message 0 content: expected text, got a lone surrogate '\\ud83d' at character 3",
        ),
        ('{"text": "broken \\udc00 escape"}', "text: expected text, got a lone surrogate"),
        ('{"text": "a", "messages": [{"role": "user", "content": "hi"}]}', "got both; pick one"),
    ],
)
def test_malformed_records_name_their_line(chat_teacher, tmp_path, record, words):
    from topkd.data.documents import iter_documents

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + record + "\n")
    with pytest.raises(ValueError) as refused:
        list(iter_documents([str(path)], AutoTokenizer.from_pretrained(chat_teacher)))
    assert str(refused.value).startswith(f"{path}:2: ") and words in str(refused.value)
