# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# torch pinned to the CPU wheel available locally; an unpinned torch pulls a multi-GB CUDA build.
# (setuptools warns on every editable install whose packages map to folders, as ours do: core/ is
# dflash_pipeline; the warning is about such folders shadowing the package, which cannot happen here: hence
# PYTHONWARNINGS.) The comments stand here, above the target, so that make does not echo them as output.
$(BIN)/dflash-pipeline: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install run test test-load unit lint test-py312
install: $(BIN)/dflash-pipeline

# Triton (~1 GB, for one unit test: pyproject's kernel-test extra) only where tests run, not for `make run`. Then the
# peers' packages the interoperability tests run (speculators' data loader, z-lab's reference decoder): without
# their dependencies, whose pins (datasets, transformers, torchvision) clash with ours; what their code paths import
# is in the test extra (docs/INTEROP.md).
$(VENV)/.kernel-test: $(BIN)/dflash-pipeline Makefile
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[test,kernel-test]'
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0
	touch $@

run: install
	$(BIN)/dflash-pipeline run --config configs/embedded.yaml $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Lint, then the unit, integration and e2e layers (all but the load tests: `make test-load`, which CI also runs), on
# two pytest-xdist workers (TEST_WORKERS=0: one process). A module's tests stay on one worker, the heaviest modules
# handed out first (tests/conftest.py; --no-loadscope-reorder keeps that order: xdist's own puts the modules with the
# most tests first, the many quick unit modules, and the long e2e ones came last).
TEST_WORKERS ?= 2
test: lint $(VENV)/.kernel-test
	$(BIN)/python -m pytest -q tests -m "not load" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(ARGS)

# 20 flow runs on three Prefect workers against a PostgreSQL-backed server, and the team server's failure cases
# (minutes; needs PostgreSQL's binaries).
test-load: install
	$(BIN)/python -m pytest -q tests -m load $(ARGS)

# The fast layer (pure functions, ~1 minute): what to run while working.
unit: $(VENV)/.kernel-test
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

# Python 3.12 with the newest versions pyproject's ranges allow (zarr 3.4.x there): the storage, prepare and
# extraction layers. torch comes from PyPI here (the CUDA build: ~0.5 GB + NVIDIA libraries; it runs on CPU).
PY312 ?= $(firstword $(wildcard /root/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null))
VENV312 ?= .venv312
$(VENV312)/bin/dflash-pipeline: pyproject.toml
	@test -n "$(PY312)" || { echo "make test-py312: no Python 3.12 found (pyenv or python3.12 on PATH): install it" \
		"(e.g. apt-get install python3.12-venv) or name it: make test-py312 PY312=/path/to/python3.12" >&2; exit 2; }
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q "torch==2.13.0"
	PYTHONWARNINGS="ignore:Editable installation" $(VENV312)/bin/pip install -q -e '.[test,kernel-test]'
	touch $@

test-py312: $(VENV312)/bin/dflash-pipeline
	$(VENV312)/bin/python -c "import sys, zarr; print('python', sys.version.split()[0], 'zarr', zarr.__version__)"
	$(VENV312)/bin/python -m pytest -q tests/unit tests/integration/test_writer.py tests/integration/test_extract.py \
		tests/integration/test_kill_resume.py tests/integration/test_dataprep.py tests/integration/test_reader.py $(ARGS)
