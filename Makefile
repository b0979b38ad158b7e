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

.PHONY: all install demo test test-fast eval eval-buried bench bench-serve lint clean catalog

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

# The labelled real failure logs: our corpus (eval/corpus, a source URL and a thread-settled label
# each) and the shared development sample. `make eval` prints accuracy, crashes called healthy,
# healthy runs called failed, calibration and what each later stage adds (leave-one-out).
EVAL_SETS ?= eval/corpus $(SHARED)/failures-dev
eval: $(STAMP)
	$(PY) -m logdx.evaluate $(EVAL_SETS) --stages

BURY ?= 1
eval-buried: $(STAMP)
	$(PY) -m logdx.evaluate $(EVAL_SETS) --no-llm --no-retrieval --bury $(BURY)

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
