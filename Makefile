# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Every dependency, direct and transitive, at the version CI tested: `make lock` refreshes it.
LOCK   := requirements.lock
SHARED ?= ../shared/data
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
LINTED := service tests bench tools
# Type-checked by mypy (configured in pyproject.toml): the whole package.
TYPED := service/logdx
# The slowest tests, listed at the end of `make test` (pytest's --durations).
SLOWEST ?= 15

.PHONY: all install model browser shippers demo test test-fast test-slow lock eval eval-quick eval-gpualert eval-buried eval-jobs bench bench-serve bench-page lint clean catalog catalog-index

all: test

# pip itself first (the lock names it), then the project with every package and every build
# dependency (setuptools for drain3's sdist, for logdx itself) at its locked version.
$(STAMP): pyproject.toml $(LOCK)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint $(LOCK) pip
	$(PY) -m pip install --quiet --constraint $(LOCK) --build-constraint $(LOCK) -e '.[dev]'
	touch $(STAMP)

# The packaged LLM, de-quantised once into the cache a plain `diagnose` uses (llm.cache_dir,
# ~/.local/share/logdx/models unless LOGDX_LLM__CACHE_DIR says otherwise): ~6 CPU-seconds, once.
model: $(STAMP)
	$(VENV)/bin/logdx model convert

# The error catalog's index (logdx.diagnose.catalog_index): what a diagnosis reads instead of parsing
# the 23k entries (~3 CPU-seconds, once; rebuilt when the catalog or its indexing code changes). Without
# it logdx builds one into <data_dir>/cache the first time it needs the catalog.
CATALOG_INDEX := service/logdx/kb/catalog.index.sqlite
$(CATALOG_INDEX): service/logdx/kb/catalog.jsonl.gz service/logdx/diagnose/catalog.py \
                  service/logdx/diagnose/catalog_index.py service/logdx/patterns.py | $(STAMP)
	$(PY) -m logdx.diagnose.catalog_index $@

catalog-index: $(CATALOG_INDEX)

install: $(STAMP) model $(CATALOG_INDEX)

# The shipper tests' real syslog-ng (Debian's, with its http() destination), installed the same way: apt,
# as root; without them those tests are skipped and say why.
shippers:
	@command -v syslog-ng >/dev/null 2>&1 && [ -n "$$(ls /usr/lib/syslog-ng/*/libhttp.so 2>/dev/null)" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq syslog-ng-core syslog-ng-mod-http >/dev/null; \
	  else echo "make shippers: no syslog-ng, and installing it needs root and apt-get: the syslog-ng tests will be skipped"; fi; }

# The browser tests' browser: Debian's chromium (apt, as root), driven by playwright's Python package
# (a dev dependency) through `executable_path`; playwright never downloads a browser of its own. Without
# root or apt, the browser tests are skipped and say why.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
browser: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "make browser: no chromium, and installing it needs root and apt-get: the browser tests will be skipped"; fi; }
	@$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install --quiet --constraint $(LOCK) playwright

demo: install
	@mkdir -p .cache/demo
	$(PY) -m logdx.synth --scenario xid79 --ranks 64 --lines 200000 --seed 7 -o .cache/demo/job.log
	$(VENV)/bin/diagnose .cache/demo/job.log --no-llm --color

# Resolve every dependency afresh (PyPI's newest releases within pyproject.toml's ranges) in a
# scratch venv and write them all to $(LOCK). Then `make test`, and commit both: that is an upgrade.
lock:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 2; }
	rm -rf .cache/lock-venv
	$(PYTHON) -m venv .cache/lock-venv
	.cache/lock-venv/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	.cache/lock-venv/bin/python -m pip install --quiet '.[dev]'
	{ echo "# Every dependency of logdx[dev], direct and transitive, as \`make lock\` resolved it on $$(date -u +%F)."; \
	  echo "# Used as pip constraints by make install, the Dockerfile and CI. Refresh: make lock && make test."; \
	  echo "# torch: the CPU build (2.13.0+cpu) or PyPI's; both satisfy torch==2.13.0."; \
	  .cache/lock-venv/bin/python -m pip freeze --all --exclude logdx | sed -E 's/^(torch==[^+]+)\+.*/\1/'; \
	} > $(LOCK).tmp && mv $(LOCK).tmp $(LOCK)
	rm -rf .cache/lock-venv $(STAMP)
	@echo "$(LOCK) written; now: make test"

# Everything: lint, unit, integration and the slow end-to-end tests (marked `slow`). Set-up
# included, it fits in 12 minutes on 2 cores; the slowest tests are listed at the end.
test: lint model browser shippers $(CATALOG_INDEX)
	$(PY) -m pytest -q -p no:cacheprovider --durations=$(SLOWEST)

# Unit tests only (no model loading, no subprocesses, no servers): well under a minute.
test-fast: $(STAMP) $(CATALOG_INDEX)
	$(PY) -m pytest -q -m "not slow and not integration" -p no:cacheprovider

# Only the slow end-to-end tests (real servers and models, long scenarios).
test-slow: $(STAMP) model $(CATALOG_INDEX)
	$(PY) -m pytest -q -m slow -p no:cacheprovider --durations=$(SLOWEST)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/mypy $(TYPED)

# Accuracy. The labelled real failure logs (our corpus, eval/corpus: a source URL and a thread-settled
# label each; the shared development sample), each of them buried in a realistic long multi-rank job,
# and whole jobs written by logdx.synth: long healthy runs, hangs, divergences, short pasted excerpts that
# end in a fatal exception, healthy runs with teardown noise and kernel lines past their end. One table
# per set (status, category, action, failure type, root line, culprit, crashes called healthy, healthy
# runs called failed, reports that said unknown; also with the exit code known), one row per cascade
# (rules; default), then a summary. Every set of logdx.evaluate's ALL_SETS runs unless EVAL_ARGS narrows it.
# `make eval` runs everything and what each later stage adds on the excerpts (leave-one-out);
# `make eval-quick` is rules only on every set (a few minutes: for iterating).
EVAL_SETS ?= eval/corpus $(SHARED)/failures-dev
EVAL_ARGS ?=
eval: install
	$(PY) -m logdx.evaluate $(EVAL_SETS) --stages $(EVAL_ARGS)
	@$(MAKE) --no-print-directory eval-gpualert

# The public GPUAlert corpus (github.com/Parv-01/gpualert-eval, MIT), from a clone of it: never committed here.
GPUALERT ?= .cache/gpualert-eval
eval-gpualert: $(STAMP)
	@if [ -e $(GPUALERT) ]; then $(PY) eval/gpualert/score.py $(GPUALERT); else \
	  echo "eval-gpualert: no clone at $(GPUALERT): git clone https://github.com/Parv-01/gpualert-eval $(GPUALERT) (skipped)"; fi

eval-quick: install
	$(PY) -m logdx.evaluate $(EVAL_SETS) --quick $(EVAL_ARGS)

BURY ?= 1
eval-buried: $(STAMP) $(CATALOG_INDEX)
	$(PY) -m logdx.evaluate $(EVAL_SETS) --sets excerpts,buried --no-llm --no-retrieval --per-case $(BURY) $(EVAL_ARGS)

eval-jobs: $(STAMP) $(CATALOG_INDEX)
	$(PY) -m logdx.evaluate --sets healthy,hangs,divergence,pasted,teardown --quick $(EVAL_ARGS)

# The error catalog (service/logdx/kb/catalog.jsonl.gz) from the frameworks' own code, at the versions
# pinned in tools/catalog/sources.toml; downloads from PyPI are cached in .cache/catalog.
catalog: $(STAMP)
	$(PY) tools/catalog/build_catalog.py
	$(MAKE) catalog-index

bench: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_compress.py --json bench-results/compress.json

bench-page: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_page.py --json bench-results/page.json

bench-serve: $(STAMP)
	@mkdir -p bench-results
	$(PY) bench/bench_serve.py --lines 1000000 --streams 64 --jobs 10 --json bench-results/serve.json

clean:
	rm -rf $(VENV) .cache .pytest_cache $(CATALOG_INDEX)

# Optional: llama-cpp-python's server, for tests/test_llm_llama_cpp.py (builds llama.cpp: ~7 CPU-minutes).
.PHONY: install-llama
install-llama: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,llama]'
