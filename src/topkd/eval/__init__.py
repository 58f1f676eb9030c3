"""Evaluation: `topkd eval`, or the functions one by one (text, against a teacher cache, multiple choice)."""

from topkd.eval.choice import evaluate_choices, load_choice_file
from topkd.eval.run import EvalConfig, run_eval
from topkd.eval.text import evaluate_text
from topkd.eval.vs_cache import evaluate_vs_cache

__all__ = [
    "EvalConfig",
    "evaluate_choices",
    "evaluate_text",
    "evaluate_vs_cache",
    "load_choice_file",
    "run_eval",
]
