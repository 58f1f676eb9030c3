"""Shared by the eval tests: the tiny teacher as an evaluated model."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    return AutoModelForCausalLM.from_pretrained(teacher_dir).eval(), AutoTokenizer.from_pretrained(
        teacher_dir
    )
