"""The README's Python examples are executed as written (the cache one against the test cache)."""

import pathlib
import re

import pytest
import torch


def test_readme_examples_run(built_cache, teacher_dir, tmp_path):
    from transformers import AutoTokenizer

    from topkd.cache import TopKCache
    from topkd.train.student import cut_layers

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3, "README should have the loss, the cache and the trainer example"
    trainer_block = next(i for i, b in enumerate(blocks) if "KDTrainer" in b)
    blocks[trainer_block] = blocks[trainer_block].replace(
        '"runs/hf", max_steps=500', f'"{tmp_path}", max_steps=2'
    )
    assert "max_steps=2" in blocks[trainer_block]  # a short run
    names = {
        "cache_path": built_cache,
        "student_vocab_size": 1000,
        "student_tokenizer": AutoTokenizer.from_pretrained(teacher_dir),
        "torch": torch,
        "student": cut_layers(TopKCache(built_cache).load_teacher().model, 1),
    }
    spaces = [dict(names) for _ in blocks]
    for code, namespace in zip(blocks, spaces):
        exec(compile(code, "README.md", "exec"), namespace)
    assert all(torch.isfinite(ns["loss"]) for i, ns in enumerate(spaces) if i != trainer_block)
    assert spaces[trainer_block]["trainer"].state.global_step == 2
    assert any("row" in ns and ns["row"]["teacher_ids"].shape[1] == 16 for ns in spaces)


def test_the_file_tree_matches_the_tree():
    """Every path docs/architecture.md's file tree names exists, and every module of the package is in it."""
    root = pathlib.Path(__file__).parents[1]
    text = (root / "docs" / "architecture.md").read_text()
    tree = text[text.index("## Files") :]
    listed = {
        m.group(1).rstrip("/")
        for m in re.finditer(r"^((?:src|tests|docs|benchmarks)/\S+)", tree, re.M)
    }
    missing = sorted(p for p in listed if not (root / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    modules = {
        str(p.relative_to(root))
        for p in (root / "src" / "topkd").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert not sorted(modules - listed), (
        f"modules missing from docs/architecture.md's tree: {sorted(modules - listed)}"
    )


def test_integrations_own_loop_runs_and_learns(built_cache):
    """docs/integrations.md's 30-line loop, executed as written: its loss falls."""
    from topkd.cache import TopKCache
    from topkd.train.student import cut_layers

    text = (pathlib.Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    loop = next(
        b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "for step in range(steps)" in b
    )
    # a page, imports included
    assert len([line for line in loop.splitlines() if line.strip()]) <= 36
    torch.manual_seed(0)
    student = cut_layers(TopKCache(built_cache).load_teacher().model, 1)
    names = {"cache_path": built_cache, "steps": 12, "student": student}
    exec(compile(loop, "docs/integrations.md", "exec"), names)
    history = names["history"]
    assert len(history) == 12 and sum(history[-3:]) < sum(history[:3])


@pytest.mark.slow  # the GGUF of `make assets`: ~2 minutes on 2 cores
def test_the_quickstart_runs_as_written_with_the_assets_gguf(tmp_path, monkeypatch):
    """README "Quickstart on your own data", command for command, with the only teacher `make assets` gives
    (a quantised GGUF, which --init-from-teacher could not cut before) and chat JSONL; only --steps is smaller."""
    import json
    import shlex

    from tests.assets import SMOLLM2, asset
    from tests.cache.tiny import make_text
    from topkd.cli import main

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## Quickstart on your own data") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [
        " ".join(part.split("#")[0].split()) for part in block.replace("\\\n", " ").splitlines()
    ]
    for name, seed in (("chats.jsonl", 0), ("heldout.jsonl", 100)):
        talks = [
            [
                {"role": "user", "content": make_text(8, seed + i)},
                {"role": "assistant", "content": make_text(20, seed + i + 50)},
            ]
            for i in range(12)
        ]
        (tmp_path / name).write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks))
    monkeypatch.chdir(tmp_path)
    for line in filter(None, lines):
        args = shlex.split(
            re.sub(r"--steps \d+", "--steps 3", line.replace("TEACHER", asset(SMOLLM2)))
        )
        assert args[0] == "topkd" and main(args[1:]) == 0, line
    metrics = [json.loads(r) for r in open(tmp_path / "runs" / "chat-student" / "metrics.jsonl")]
    assert len(metrics) == 3 and all(r["tokens"] > 0 for r in metrics)
