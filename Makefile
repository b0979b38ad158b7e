# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SHARED ?= ../shared/data
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LOGDX_LLM__CACHE_DIR ?= $(CURDIR)/.cache/logdx

.PHONY: all install demo test test-fast eval eval-buried bench bench-serve lint clean

all: test

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@mkdir -p .cache/demo
	$(PY) -m logdx.synth --scenario xid79 --ranks 64 --lines 200000 --seed 7 -o .cache/demo/job.log
	$(VENV)/bin/diagnose .cache/demo/job.log --no-llm --color

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

eval: $(STAMP)
	$(PY) -m logdx.evaluate $(SHARED)/failures-dev

BURY ?= 3
eval-buried: $(STAMP)
	$(PY) -m logdx.evaluate $(SHARED)/failures-dev --bury $(BURY)

bench: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_compress.py --json bench-results/compress.json

bench-serve: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_serve.py --lines 1000000 --streams 64 --jobs 10 --json bench-results/serve.json

clean:
	rm -rf $(VENV) .cache .pytest_cache
