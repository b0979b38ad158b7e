# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SHARED ?= ../shared/data
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LOGDX_LLM__CACHE_DIR ?= $(CURDIR)/.cache/logdx
LINTED := service tests bench tools

.PHONY: all install demo test test-fast eval eval-quick eval-buried eval-jobs bench bench-serve lint clean catalog

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

test: lint
	$(PY) -m pytest -q

# Unit tests only (no model loading, no subprocesses, no servers): well under a minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not integration" -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)

# Accuracy. The labelled real failure logs (our corpus, eval/corpus: a source URL and a thread-settled
# label each; the shared development sample), each of them buried in a realistic long multi-rank job,
# and whole jobs written by logdx.synth: long healthy runs, hangs, divergences. One table per set
# (status, category, action, failure type, root line, culprit, crashes called healthy, healthy runs
# called failed; also with the exit code known), one row per cascade (rules; default), then a summary.
# `make eval` runs everything and what each later stage adds on the excerpts (leave-one-out);
# `make eval-quick` is rules only on every set (a few minutes: for iterating).
EVAL_SETS ?= eval/corpus $(SHARED)/failures-dev
EVAL_ARGS ?=
eval: $(STAMP)
	$(PY) -m logdx.evaluate $(EVAL_SETS) --stages $(EVAL_ARGS)

eval-quick: $(STAMP)
	$(PY) -m logdx.evaluate $(EVAL_SETS) --quick $(EVAL_ARGS)

BURY ?= 1
eval-buried: $(STAMP)
	$(PY) -m logdx.evaluate $(EVAL_SETS) --sets excerpts,buried --no-llm --no-retrieval --per-case $(BURY) $(EVAL_ARGS)

eval-jobs: $(STAMP)
	$(PY) -m logdx.evaluate --sets healthy,hangs,divergence --quick $(EVAL_ARGS)

# The error catalog (service/logdx/kb/catalog.jsonl.gz) from the frameworks' own code, at the versions
# pinned in tools/catalog/sources.toml; downloads from PyPI are cached in .cache/catalog.
catalog: $(STAMP)
	$(PY) tools/catalog/build_catalog.py

bench: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_compress.py --json bench-results/compress.json

bench-serve: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_serve.py --lines 1000000 --streams 64 --jobs 10 --json bench-results/serve.json

clean:
	rm -rf $(VENV) .cache .pytest_cache

# Optional: llama-cpp-python's server, for tests/test_llm_llama_cpp.py (builds llama.cpp: ~7 CPU-minutes).
.PHONY: install-llama
install-llama: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,llama]'
