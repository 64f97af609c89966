# Every target that needs the project installs it first, into .venv, from python3 alone.
# `make run` installs what the server needs and nothing more; `make test` adds the test
# extras (pytest, hypothesis, selenium, ruff...), `make bench` the plotting one.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed
TESTING := $(VENV)/.installed-test
BENCHING := $(VENV)/.installed-bench

.PHONY: install install-test test lint run bench bench-watchers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(RUNTIME): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUNTIME)

$(TESTING): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(RUNTIME) $(TESTING)

$(BENCHING): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $(RUNTIME) $(BENCHING)

install: $(RUNTIME)

install-test: $(TESTING)

# The project's own files only (pyproject.toml says which): never a user's scratch files.
lint: $(TESTING)
	$(BIN)/ruff check relay cli scripts tests
	$(BIN)/ruff format --check relay cli scripts tests

test: lint
	$(BIN)/pytest

run: $(RUNTIME)
	$(BIN)/relay-trio server --db relay.db

bench: $(BENCHING)
	$(BIN)/relay-bench --json bench.json

# What a watcher costs: each scenario with none, an idle one and one of every event.
bench-watchers: $(BENCHING)
	$(BIN)/relay-bench --watchers --json bench-watchers.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
