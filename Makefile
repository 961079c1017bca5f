# Every target does its own set-up on a fresh machine: a virtual environment in .venv,
# torch==2.13.0 first (a CPU wheel; any other version downloads gigabytes), then medfl.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/medfl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/medfl

setup: $(BIN)/medfl

demo: setup
	cd bundles/demo && ../../$(BIN)/python -m monai.bundle run --config_file configs/train.json

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) bundles/*/runs bundles/*/data
