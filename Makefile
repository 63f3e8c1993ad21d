# The two commands: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first and pinned: this pin is a local CPU wheel here; an unpinned torch pulls CUDA builds.
TORCH  := torch==2.13.0

.PHONY: demo test install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'

demo: install
	$(BIN)/asyncrl run

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
