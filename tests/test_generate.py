"""The student's completions: left-padded batched greedy equals one prompt at a time by hand, sampling is a pure
function of the seed, a completion ends at (and keeps) its first stop id, and the model is given back as it was."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from topkd.models.generate import GenerationSettings, _through_stop, generate

PROMPTS = [np.array([5, 6, 7, 8, 9, 10, 11]), np.array([3, 4]), np.array([12, 13, 14, 15])]


@pytest.fixture(scope="module")
def model(teacher_dir):
    m = AutoModelForCausalLM.from_pretrained(teacher_dir).train()
    m.config.use_cache = False
    return m


def _greedy_by_hand(model, prompt, n):
    x = torch.from_numpy(prompt)[None]
    with torch.no_grad():
        for _ in range(n):  # the whole sequence every time: no cache, no padding
            x = torch.cat([x, model(x).logits[0, -1].argmax().view(1, 1)], 1)
    return x[0, len(prompt) :].numpy()


def test_batched_left_padded_greedy_is_each_prompt_alone(model):
    got = generate(model, PROMPTS, GenerationSettings(12, temperature=0.0), 0, [999_999], 0)
    for prompt, completion in zip(PROMPTS, got):
        assert len(completion) == 12
        np.testing.assert_array_equal(completion, _greedy_by_hand(model, prompt, 12))
    assert model.training and model.config.use_cache is False  # given back as it was


def test_sampling_is_a_pure_function_of_the_seed(model):
    settings = GenerationSettings(16, temperature=1.0, top_p=0.9)
    a, b, c = (generate(model, PROMPTS, settings, seed, [999_999], 0) for seed in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_a_completion_ends_at_its_first_stop_id_which_it_keeps(model):
    assert _through_stop(np.array([4, 9, 2, 9, 0, 0]), [9]).tolist() == [4, 9]
    assert _through_stop(np.array([4, 5, 6]), [9]).tolist() == [4, 5, 6]  # the cap: no stop
    greedy = generate(model, PROMPTS[:1], GenerationSettings(12, 0.0), 0, [999_999], 0)[0]
    stop = int(
        greedy[4]
    )  # make the fifth greedy token a stop id: the completion ends at its first use
    again = generate(model, PROMPTS[:1], GenerationSettings(12, 0.0), 0, [stop], 0)[0]
    first = int(np.flatnonzero(greedy == stop)[0])
    np.testing.assert_array_equal(again, greedy[: first + 1])
