# Two commands do all set-up: `make demo` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@# peer for the agreement test and the benchmark; pure torch, so its triton dependency is skipped
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps liger-kernel==0.8.5
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/topkd bench loss --lengths 1024,4096,16384 --out runs/demo-bench

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

clean:
	rm -rf .venv runs
