"""`topkd eval` end to end: JSON output, refusals, the lm-eval bridge's refusals."""

import json

import pytest

from topkd.cli import main


def test_cli_writes_json_and_prints_it_last(teacher_dir, text_file, built_cache, tmp_path, capsys):
    out = tmp_path / "eval.json"
    main(
        [
            "eval",
            "--model",
            teacher_dir,
            "--text",
            text_file,
            "--max-tokens",
            "300",
            "--seq-len",
            "64",
            "--cache",
            built_cache,
            "--max-sequences",
            "2",
            "--out",
            str(out),
        ]
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.load(open(out))["result"] and last["text"]["tokens"] == 300
    assert set(last["vs_teacher"]) >= {
        "kl_bucket",
        "kl_renorm",
        "top1_agreement",
        "student_mass_on_topk",
    }


def test_nothing_to_evaluate_is_refused(teacher_dir):
    from topkd.eval import EvalConfig, run_eval

    with pytest.raises(ValueError, match="expected something to evaluate"):
        run_eval(EvalConfig(model=teacher_dir))
    with pytest.raises(ValueError, match="expected --model"):
        run_eval(EvalConfig(text=["x.txt"]))


def test_lm_eval_bridge_refuses_what_the_harness_cannot_load(teacher_dir, tmp_path):
    from topkd.eval import EvalConfig
    from topkd.eval.run import run_lm_eval

    with pytest.raises(ValueError, match="expected a Hugging Face model directory"):
        run_lm_eval(EvalConfig(model="teacher.gguf", lm_eval=["boolq"]))
    with pytest.raises(ValueError, match="expected a directory of lm-eval task YAMLs"):
        run_lm_eval(
            EvalConfig(model=teacher_dir, lm_eval=["x"], lm_eval_include=str(tmp_path / "none"))
        )
