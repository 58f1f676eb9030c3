"""The table of target kinds (topkd/cache/format/targets.py): what each kind allows, and that nothing else asks its
name.

python -m pytest tests/cache/test_targets.py
"""

import ast
import pathlib
from types import SimpleNamespace

import pytest

from tests.test_target_kinds import KINDS as MATRIX_KINDS
from topkd.cache.format.targets import TARGET_KINDS, kind_of_manifest, target_kind

SRC = pathlib.Path(__file__).parents[2] / "src" / "topkd"
TABLE = SRC / "cache" / "format" / "targets.py"


def _kind_names_compared(tree: ast.AST) -> list[int]:
    """Lines where a kind's name is an operand of ==, !=, in or not in (a tuple of names counts)."""

    def names(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in TARGET_KINDS
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names(e) for e in node.elts)
        return False

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(names(n) for n in [node.left, *node.comparators])
    ]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_but_the_table_compares_a_kind_by_name(path):
    if path == TABLE:
        return
    lines = _kind_names_compared(ast.parse(path.read_text()))
    assert not lines, (
        f"{path.relative_to(SRC)}:{lines} compares a target kind's name: ask TARGET_KINDS"
    )


def test_the_name_check_finds_a_comparison():
    tree = ast.parse(
        'if cache.targets == "sampled": pass\nok = kind in ("topp", "x")\nfine = "topk"'
    )
    assert _kind_names_compared(tree) == [1, 2]


def test_every_kind_is_in_the_command_matrix():
    in_matrix = {options.get("targets", "topk") for options in MATRIX_KINDS.values()}
    assert in_matrix == set(TARGET_KINDS)


def test_only_draws_limit_what_a_student_trains_with():
    sampled, topk, topp = TARGET_KINDS["sampled"], TARGET_KINDS["topk"], TARGET_KINDS["topp"]
    for divergence in ("kl", "jsd", "tvd"):
        assert sampled.training_problem(divergence, 1.0, 0) is None
    for args in (("reverse_kl", 1.0, 0), ("kl", 2.0, 0), ("kl", 1.0, 8)):
        problem = sampled.training_problem(*args)
        assert "expected divergence kl|jsd|tvd, temperature 1 and no top_k" in problem
        assert topk.training_problem(*args) is None and topp.training_problem(*args) is None


def test_widths_counts_and_labels_follow_the_settings():
    cfg = SimpleNamespace(k=100, samples=50, head=0, top_p=0.95, min_k=4)
    sampled = TARGET_KINDS["sampled"]
    assert [kind.row_width(cfg) for kind in TARGET_KINDS.values()] == [100, 50, 100]
    assert sampled.counts_of(cfg) == 50 and sampled.label(cfg) == "sampled N=50"
    cfg.head = 8  # a hybrid: the exact head's values are no count / N
    assert sampled.row_width(cfg) == 58 and sampled.counts_of(cfg) is None
    assert sampled.label(cfg) == "sampled head 8 + N=50"
    assert (
        TARGET_KINDS["topk"].counts_of(cfg) is None and TARGET_KINDS["topk"].label(cfg) == "top-100"
    )


def test_manifests_name_their_kind_and_old_ones_are_top_k():
    assert kind_of_manifest({}).name == "topk"  # built before other kinds existed
    assert kind_of_manifest({"targets": {"kind": "topp", "top_p": 0.9}}).name == "topp"
    with pytest.raises(
        ValueError, match=r"targets: expected one of \('topk', 'sampled', 'topp'\), got 'dense'"
    ):
        target_kind("dense")


def test_settings_keep_the_top_k_build_hash():
    cfg = SimpleNamespace(k=100, samples=50, head=0, top_p=0.95, min_k=4)
    assert (
        TARGET_KINDS["topk"].settings(cfg) is None
    )  # no "targets" key: the hash older caches have
    assert TARGET_KINDS["sampled"].settings(cfg) == {
        "kind": "sampled",
        "samples": 50,
        "temperature": 1.0,
    }
