# Two commands on a fresh machine with Python 3.10+ and make:
#   make demo   -- plan HuggingFace GPT-2 for a GPU cluster, then train one on 4 local processes under its plan
#   make test   -- ruff, the import layers (import-linter), then the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build; an unpinned torch would pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest -n auto --dist loadfile --durations=25

clean:
	rm -rf $(VENV)
