# Everything a newcomer or CI needs: a local virtual environment with the project installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

## demo: simulate Aliev–Panfilov spirals, forget six parameters, recover them
demo: setup
	$(BIN)/pdefit-fit

## test: lint and run the whole test suite
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

## bench: the adjoint benchmark (pdefit schedules vs diffrax), quick variant
bench: setup
	$(BIN)/python benchmarks/adjoint.py --quick

clean:
	rm -rf $(VENV) runs outputs multirun .pytest_cache .ruff_cache
