# Every target does its own set-up on a fresh machine: a virtual environment in .venv,
# torch==2.13.0 first (a CPU wheel; any other version downloads gigabytes), then medfl.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# test workers (pytest-xdist); each worker's torch gets its share of the cores (tests/conftest.py).
# Three on two cores: the real-deployment tests spend minutes waiting on Flower's own clocks (a
# killed SuperNode is declared gone after its heartbeat lapses), which a third worker fills
# (benchmarks/README.md, "The test suite in three workers")
TEST_WORKERS ?= 3

.PHONY: setup demo test bench clean

$(BIN)/medfl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/medfl

setup: $(BIN)/medfl

# from the repository root, so the "results:" path it prints is one from where you are
demo: setup
	$(BIN)/python -m monai.bundle run --config_file bundles/demo/configs/train.json --bundle_root bundles/demo

# Whole test modules go to a worker at a time (module fixtures start their federation or data
# once), slowest first (tests/conftest.py's SLOW_MODULES, kept in order by
# --no-loadscope-reorder); TEST_WORKERS=1 runs them one after another in one process.
test: setup
ifeq ($(TEST_WORKERS),1)
	$(BIN)/python -m pytest -q
else
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
endif

bench: setup
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) bundles/*/runs bundles/*/data
