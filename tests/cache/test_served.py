"""The served teacher (topkd/cache/building/served.py): vLLM's and the echo dialect's recorded shapes parsed by hand,
and the client against a vLLM-shaped server process over the tiny teacher (tests/cache/served_server.py): the same
rows as the teacher in memory, and one line naming the server for a cap, a timeout, a short answer, another
model's tokenizer or ids."""

import numpy as np
import pytest

from tests.cache import served_server
from topkd.cache.building.served import (
    ServedTeacher,
    api_urls,
    echo_entries,
    id_strings,
    vllm_entries,
)
from topkd.cache.building.teacher import load_teacher
from topkd.data.documents import Sequence

# vLLM's completions response for prompt [5, 9, 2], prompt_logprobs=2, logprobs=2, return_tokens_as_token_ids
RECORDED_VLLM = {
    "index": 0,
    "text": "x",
    "logprobs": {
        "tokens": ["token_id:4"],
        "token_logprobs": [-0.2],
        "top_logprobs": [{"token_id:4": -0.2, "token_id:1": -1.9}],
        "text_offset": [0],
    },
    "prompt_logprobs": [
        None,
        {
            "9": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
            "3": {"logprob": -2.5, "rank": 2, "decoded_token": "b"},
        },
        {
            "7": {"logprob": -0.3, "rank": 1, "decoded_token": "c"},
            "4": {"logprob": -1.5, "rank": 2, "decoded_token": "d"},
            "2": {
                "logprob": -6.0,
                "rank": 9,
                "decoded_token": "e",
            },  # the actual token, outside the top 2
        },
    ],
}


def sequence(tokens) -> Sequence:
    return Sequence(np.asarray(tokens, np.int64), np.zeros(1, np.int64), 0, 0)


def test_vllm_positions_shift_by_one_and_the_extra_entry_is_dropped():
    rows = vllm_entries([5, 9, 2], RECORDED_VLLM, k=2)
    assert rows == [[(9, -0.1), (3, -2.5)], [(7, -0.3), (4, -1.5)], [(4, -0.2), (1, -1.9)]]
    short = {**RECORDED_VLLM, "prompt_logprobs": RECORDED_VLLM["prompt_logprobs"][:2]}
    with pytest.raises(ValueError, match="expected prompt_logprobs of 3 positions"):
        vllm_entries([5, 9, 2], short, k=2)
    strings = {**RECORDED_VLLM, "logprobs": {"top_logprobs": [{"x": -0.2}]}}
    with pytest.raises(ValueError, match="token_id:N"):
        vllm_entries([5, 9, 2], strings, k=2)


def test_echo_strings_map_back_to_ids_and_other_tokens_are_not_guessed():
    strings = ["a", "b", "c", None, None]
    id_of = {
        "a": 0,
        "b": 1,
        "c": 2,
    }  # id 3 is special (the server prints ''), id 4 a partial character
    openai = {  # OpenAI's layout: the piece [a, b, 3] and the generated c, entry t over token t
        "logprobs": {
            "tokens": ["a", "b", "", "c"],
            "top_logprobs": [
                None,
                {"b": -0.1, "": -3.0},
                {"": -0.5, "c": -1.2},
                {"c": -0.05, "a": -4.0},
            ],
        }
    }
    assert echo_entries([0, 1, 3], openai, 2, id_of, strings) == [
        [(1, -0.1)],
        [(2, -1.2)],
        [(2, -0.05), (0, -4.0)],
    ]
    # llama-cpp-python's: entry t is the distribution computed at position t, the first null, the last row none
    llama = {
        "logprobs": {
            "tokens": ["a", "b", ""],
            "top_logprobs": [None, {"c": -0.2}, {"a": -0.7, "": -1.0}],
        }
    }
    assert echo_entries([0, 1, 3], llama, 2, id_of, strings) == [None, [(2, -0.2)], [(0, -0.7)]]
    bos = {
        "logprobs": {"tokens": ["b", ""], "top_logprobs": [None, {"a": -0.7}]}
    }  # it left out a leading BOS
    assert echo_entries([0, 1, 3], bos, 2, id_of, strings, bos=0) == [None, [(0, -0.7)], None]
    other = {"logprobs": {**openai["logprobs"], "tokens": ["a", "c", "", "c"]}}
    assert echo_entries([0, 1, 3], other, 2, id_of, strings) == [None] * 3  # it read other tokens
    assert (
        api_urls("http://h:8000")
        == api_urls("http://h:8000/v1/")
        == ("http://h:8000/v1", "http://h:8000")
    )


def test_id_strings_keep_only_unambiguous_strings(teacher_dir):
    tokenizer = load_teacher(teacher_dir).tokenizer
    strings, id_of = id_strings(tokenizer, len(tokenizer) + 3)
    assert len(strings) == len(tokenizer) + 3 and all(strings[i] == s for s, i in id_of.items())
    assert (
        strings[tokenizer.eos_token_id] is None and strings[-1] is None
    )  # special, past the tokenizer
    assert len(set(id_of.values())) == len(id_of)


@pytest.fixture(scope="module")
def server(teacher_dir):
    srv, url = served_server.start(teacher_dir, cap=8)
    yield url
    served_server.stop(srv)


def served(url, teacher, k=8, **kw) -> ServedTeacher:
    return ServedTeacher(url, teacher.tokenizer, teacher.vocab, k, **kw)


def test_rows_through_the_server_are_the_teachers(server, teacher_dir):
    teacher = load_teacher(teacher_dir)
    client = served(server, teacher)
    assert client.api == "vllm" and client.model == "tiny-teacher"
    seqs = [
        sequence(teacher.tokenizer.encode("the cat sat on the mat and the dog")),
        sequence([3, 4, 5, 6, 7]),
    ]
    got = client.sequence_rows(seqs, 8)
    want = teacher.sequence_rows(seqs, 8, (), 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.ids, w.ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
        np.testing.assert_allclose(g.log_tail, w.log_tail, atol=1e-4)  # 1 - kept mass, not summed
        assert g.scored.all()


def test_the_servers_cap_is_refused_with_both_remedies(server, teacher_dir):
    with pytest.raises(
        ValueError, match=r"teacher server .*refuses 12 log-probs.*--online-k.*--max-logprobs"
    ):
        served(server, load_teacher(teacher_dir), k=12)


def test_another_models_tokenizer_is_refused_before_scoring(server, chat_teacher_dir):
    chat = load_teacher(
        chat_teacher_dir
    )  # the same words, and ChatML's special tokens the server lacks
    with pytest.raises(ValueError, match="another model's tokenizer"):
        served(server, chat)


def test_a_slow_short_or_foreign_answer_is_one_line_naming_the_server(teacher_dir):
    teacher = load_teacher(teacher_dir)
    slow, url = served_server.start(teacher_dir, delay=2.0)
    with pytest.raises(
        ValueError, match=rf"teacher server {url}: .*no answer on /v1/completions within 0.5 s"
    ):
        served(url, teacher, timeout=0.5)
    served_server.stop(slow)

    def shorten(choices):
        return [{**c, "prompt_logprobs": c["prompt_logprobs"][:-1]} for c in choices]

    def foreign(choices):
        last = choices[0]["logprobs"]["top_logprobs"][0]
        choices[0]["logprobs"]["top_logprobs"][0] = {"token_id:99999": -0.1, **last}
        return choices

    for mangle, message in (
        (shorten, "expected prompt_logprobs of"),
        (foreign, "another model's ids"),
    ):
        broken, url = served_server.start(teacher_dir, mangle=mangle)
        with pytest.raises(ValueError, match=rf"^teacher server {url}: .*{message}") as info:
            served(url, teacher)
        assert "\n" not in str(info.value)
        served_server.stop(broken)
    with pytest.raises(ValueError, match=r"could not reach /v1/models .*is the server up"):
        served(url, teacher)  # shut down
