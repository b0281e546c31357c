# hvdcompress: the two commands of the README are `make train` and `make test`.
#
#   make setup   set up system packages, the venv, Horovod and the package (scripts/setup.sh)
#   make test    setup (with test extras), lint, then the whole suite (scripts/run_tests.sh)
#   make lint    ruff check + ruff format --check + the import layers (lint-imports)
#   make bench   codec micro-benchmark (scripts/bench_codec.py)
#   make train   setup, then the main job (TRAIN_CMD)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.NOTPARALLEL:
.DEFAULT_GOAL := help

VENV ?= $(if $(HVDC_VENV),$(HVDC_VENV),.venv)
export HVDC_VENV := $(VENV)
PY := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff

# Open MPI refuses to start as root without these; harmless for other users.
MPI_ROOT_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The main job: a short 3LC-compressed Fashion-MNIST training on 4 ranks with horovodrun
# (over MPI), ending with its summary: accuracy and traffic saved vs uncompressed.
TRAIN_CMD ?= $(MPI_ROOT_ENV) $(VENV)/bin/horovodrun -np 4 -H localhost:4 \
	$(PY) scripts/train.py --compression 3lc --steps 300 --log-dir results/train

.PHONY: help setup test lint bench train

help:
	@sed -n '3,8p' Makefile | sed 's/^# \{0,1\}//'

setup:
	bash scripts/setup.sh

# Test runs also install CuPy (without a GPU the GPU tests then skip: see scripts/setup.sh).
test: export HVDC_TEST := 1
test: setup lint
	bash scripts/run_tests.sh

lint:
	@test -x $(RUFF) || { echo "no $(RUFF): run 'make setup' first" >&2; exit 1; }
	$(RUFF) check .
	$(RUFF) format --check .
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) scripts/bench_codec.py

train: setup
	$(TRAIN_CMD)
