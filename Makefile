# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/dflash-pipeline: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch pinned to the CPU wheel available locally; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install run test unit lint
install: $(BIN)/dflash-pipeline

run: install
	$(BIN)/dflash-pipeline run --config configs/embedded.yaml $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Everything: lint, then the unit, integration and e2e layers.
test: lint
	$(BIN)/python -m pytest -q tests $(ARGS)

# The fast layer (pure functions, seconds): what to run while working.
unit: install
	$(BIN)/python -m pytest -q tests/unit $(ARGS)
