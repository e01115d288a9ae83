# Every target installs the stack into .venv on first use (scripts/setup_env.sh; a no-op afterwards).
PY := .venv/bin/python
CONFIG ?= configs/cpu_demo.yaml
# pytest-xdist workers for `make test`: the suite's processes leave about a third of two cores idle
# (start-up, imports, waits); a second worker fills it. Whole modules go to a worker (loadfile),
# in the order tests/conftest.py collects them (the longest first)
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast lint format bench

setup:
	@bash scripts/setup_env.sh

demo: setup            ## the main job: a small GRPO run on CPU with a built-in tiny model
	$(PY) -m rltrain.train --config $(CONFIG)

test: setup            ## the whole CPU suite, slow end-to-end tests included (what CI runs), on two workers
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: setup       ## unit and invariance tests only (seconds)
	$(PY) -m pytest -m "not slow and not gpu"

lint: setup
	$(PY) -m ruff check rltrain tests benchmarks examples scripts
	$(PY) -m ruff format --check rltrain tests benchmarks examples scripts

format: setup
	$(PY) -m ruff check --fix rltrain tests benchmarks examples scripts
	$(PY) -m ruff format rltrain tests benchmarks examples scripts

bench: setup           ## every benchmark, each printing a small table (installs trl for the peer comparison)
	@$(PY) -c "import trl" 2>/dev/null || $(PY) -m pip install -q -c constraints-cpu.txt "trl==1.16.0"
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done
