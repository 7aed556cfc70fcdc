# The two commands of the README: `make run` (set up, then a real run on the embedded
# default) and `make test` (set up, then the whole test suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.jetrl-installed

.PHONY: venv run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: a looser requirement resolved first would download a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,export,verifiers]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/jetrl run configs/demo.toml

# mypy's files and settings are in pyproject.toml ([tool.mypy]).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
