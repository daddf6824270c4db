# One command sets up and runs each job on a fresh machine (see README.md).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo test lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/weightbus demo

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
