# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist
# OUT=DIR writes the run there; by default each `make run` gets a fresh runs/default, runs/default-2, ...
OUT    ?=
OUTARG := $(if $(OUT),--out $(OUT),)

.PHONY: run test lint bench data clean

# Python may keep the bytecode of what it imports (under __pycache__, ignored by git) even where the environment says
# not to: without it every process compiles torch's modules again (import torch 3.6 s instead of 1.4 s here), and the
# tests start many processes (the CLI's, torchrun's ranks).
export PYTHONDONTWRITEBYTECODE :=

# --no-compile: no .pyc files for all of torch at install time (73 s -> 19 s here); Python compiles the modules it
# imports on first use. The hf extra (transformers, peft) is installed too, so that the tests of Hugging Face models
# and text files run here and in CI.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[dev,hf]'
	touch $(STAMP)

# Fashion-MNIST comes from Debian's package; install it when missing and we can (root).
data:
	@if [ ! -f $(FMNIST)/train-images-idx3-ubyte.gz ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing Fashion-MNIST (Debian package dataset-fashion-mnist)..."; \
	    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 \
	      || echo "Could not install dataset-fashion-mnist with apt-get."; \
	  else \
	    echo "Fashion-MNIST is missing and this user cannot apt-get install dataset-fashion-mnist."; \
	  fi; \
	fi

# The main job: Tramer & Boneh's ScatterNet + linear recipe on Fashion-MNIST at epsilon 3 (configs/default.toml);
# scikit-learn digits if Fashion-MNIST cannot be had.
run: $(STAMP) data
	@if [ -f $(FMNIST)/train-images-idx3-ubyte.gz ]; then \
	  $(BIN)/dptrain train --config configs/default.toml $(OUTARG); \
	else \
	  echo "Fashion-MNIST not found under $(FMNIST): falling back to scikit-learn's bundled digits data set."; \
	  $(BIN)/dptrain train --config configs/digits.toml $(OUTARG); \
	fi

# Two workers, one per core (tests/conftest.py keeps each worker's torch on one thread); an idle worker takes tests
# from the other's queue (worksteal), so the long ones (torchrun's ranks, kill -9) do not leave it waiting at the end
# (164 s instead of 178 s here, 2026-11-28).
test: $(STAMP) data
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
