# Every target that needs the project installs it first, into .venv, from python3 alone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint run bench bench-watchers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest

run: $(STAMP)
	$(BIN)/relay-trio server --db relay.db

bench: $(STAMP)
	$(BIN)/relay-bench --json bench.json

# What a watcher costs: each scenario with none, an idle one and one of every event.
bench-watchers: $(STAMP)
	$(BIN)/relay-bench --watchers --json bench-watchers.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
