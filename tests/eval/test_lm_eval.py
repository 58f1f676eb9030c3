"""The lm-eval bridge against the real harness (extra topkd[eval]; `make test-slow` installs it).

A local multiple-choice task is scored twice: by lm-evaluation-harness through `topkd eval --lm-eval`
(task YAML from --lm-eval-include) and by topkd's own `--choices`. Same prompts, so the same
per-choice log-likelihoods, acc and acc_norm.
"""

import json

import pytest

from topkd.cache.building.teacher import load_teacher
from topkd.eval import EvalConfig
from topkd.eval.choice import evaluate_choices, load_choice_file, score_item
from topkd.eval.run import run_eval

pytestmark = pytest.mark.slow

WORDS = [
    "stone",
    "a river of silver light",
    "the king",
    "seven",
    "no",
    "an old and weary horse",
    "blue",
    "yes",
    "the sea at night",
    "bread",
    "fire",
    "a long forgotten song of the north",
]
TASK_YAML = """task: topkd_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture
def local_task(tmp_path):
    rows = [
        {
            "question": f"What is {WORDS[i % 12]} like?",
            "choices": [WORDS[(i + j * 5) % 12] for j in range(2 + i % 3)],
            "answer": i % (2 + i % 3),
        }
        for i in range(24)
    ]
    data = tmp_path / "local_choice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_choice.yaml").write_text(TASK_YAML.format(data=data))
    return str(data), str(tasks)


def test_harness_on_a_local_task_agrees_with_topkd_choices(teacher_dir, local_task, monkeypatch):
    import lm_eval  # not installed: run `make test-slow`, which installs the eval extra

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data, tasks = local_task
    ours = run_eval(EvalConfig(model=teacher_dir, choices=[data]))["choices:local_choice"]
    theirs = run_eval(
        EvalConfig(model=teacher_dir, lm_eval=["topkd_local_choice"], lm_eval_include=tasks)
    )
    metrics = theirs["lm_eval"]["topkd_local_choice"]
    # a test that can tell the two apart
    assert 0 < ours["acc"] < 1 and ours["acc"] != ours["acc_norm"]
    assert metrics["acc,none"] == pytest.approx(ours["acc"]) and metrics[
        "acc_norm,none"
    ] == pytest.approx(ours["acc_norm"])

    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={teacher_dir}",
        tasks=["topkd_local_choice"],
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path=tasks),
    )
    samples = sorted(out["samples"]["topkd_local_choice"], key=lambda s: s["doc_id"])
    teacher = load_teacher(teacher_dir, "float32", "cpu")
    items, _ = load_choice_file(data)
    for sample, item in zip(samples, items, strict=True):
        harness = [float(r[0][0]) for r in sample["resps"]]
        assert score_item(teacher.model, teacher.tokenizer, item) == pytest.approx(
            harness, rel=1e-4, abs=1e-4
        )
        ours = evaluate_choices(teacher.model, teacher.tokenizer, [item])
        assert (ours["acc"], ours["acc_norm"]) == (sample["acc"], sample["acc_norm"])


def test_a_task_whose_data_is_not_on_disk_fails_at_once_naming_the_remedy(teacher_dir, monkeypatch):
    """--lm-eval hellaswag retried the hub for ~2 minutes and failed without a remedy."""
    import time

    pytest.importorskip("lm_eval")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    with pytest.raises(ValueError, match="could not run it offline .*--lm-eval-include DIR"):
        run_eval(EvalConfig(model=teacher_dir, lm_eval=["hellaswag"], limit=2))
    assert time.monotonic() - start < 60
