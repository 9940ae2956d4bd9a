# bertjax: `make pretrain` and `make test` do all the set-up they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/demo.py
WORKDIR ?= workdirs/$(basename $(notdir $(CONFIG)))
ARGS ?=
TASK ?= glue/sst2
INIT ?=
FT_CONFIG ?= configs/glue.py
PYTEST_ARGS ?=
# Test processes (pytest-xdist; each file's tests stay in one process): 2 on the 2-core CI.
PYTEST_WORKERS ?= 2
# Accelerator-specific JAX build: tpu on TPU VMs, cuda on NVIDIA boxes, cpu elsewhere.
JAX_EXTRA ?= $(shell if ls /dev/accel* /dev/vfio/* >/dev/null 2>&1; then echo tpu; \
	elif command -v nvidia-smi >/dev/null 2>&1; then echo cuda; else echo cpu; fi)

BEAM_VENV ?= .venv-beam

.PHONY: install install-test pretrain finetune test test-beam test-fast bench device-check device-wheels lint format clean

$(BIN)/.installed: setup.cfg pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "bertjax needs Python 3.11+")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(JAX_EXTRA)]"
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[$(JAX_EXTRA),test]"
	touch $@

# Apache Beam pins its own protobuf/pyarrow: its own environment, installed as the README says.
$(BEAM_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(BEAM_VENV)/bin/python || $(PYTHON) -m venv $(BEAM_VENV)
	$(BEAM_VENV)/bin/python -m pip install -q --upgrade pip
	$(BEAM_VENV)/bin/python -m pip install -q -e ".[beam,parquet]" "pytest>=8" "gcp-storage-emulator>=2026.7"
	touch $@

install: $(BIN)/.installed

install-test: $(BIN)/.installed-test

pretrain: install
	$(BIN)/bertjax pretrain --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

finetune: install
	$(BIN)/bertjax finetune --config=$(FT_CONFIG) --config.task=$(TASK) \
		--config.init_checkpoint=$(INIT) --workdir=workdirs/finetune/$(subst /,_,$(TASK)) $(ARGS)

test: install-test
	$(BIN)/ruff check bertjax tests configs
	$(BIN)/python -m pytest -q -rs --durations=10 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests
	$(MAKE) test-beam

# The Beam DirectRunner writes the local path's shards byte for byte (skipped in .venv: no Beam there).
test-beam: $(BEAM_VENV)/.installed
	$(BEAM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_beam_prepare.py

test-fast: install-test
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

bench: install
	$(BIN)/bertjax bench $(ARGS)

# The accelerator check (launch/device_check.sh): OUT=DIR for the report, BUDGET_S=seconds,
# DRY=1 on a machine without one. DEVICE_PYTHON: the python whose JAX sees the accelerator.
OUT ?= device_report
BUDGET_S ?= 480
DRY ?=
DEVICE_PYTHON ?= python3
device-check:
	$(if $(DRY),$(MAKE) install-test && PYTHON=$(BIN)/python ,PYTHON=$(DEVICE_PYTHON) )launch/device_check.sh \
		$(if $(DRY),--dry) --out $(OUT) --budget_s $(BUDGET_S)

# The small pure-Python wheels an accelerator image with JAX lacks (no network there): into .whl/.
DEVICE_WHEELS ?= ml-collections==1.1.0
device-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl $(DEVICE_WHEELS)

lint: install-test
	$(BIN)/ruff check bertjax tests configs
	$(BIN)/ruff format --check bertjax tests configs

format: install-test
	$(BIN)/ruff format bertjax tests configs

clean:
	rm -rf $(VENV) $(BEAM_VENV) workdirs *.egg-info
