# Two commands do all set-up on a fresh machine:
#   make example   the main job: a strategy search and a short training run of a small Llama over
#                  2 CPU processes (gloo); prints the report, saves the winner to best_strategy.json
#   make test      the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; a bare `pip install torch` would fetch a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup example test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: setup.py $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

example: setup
	$(BIN)/torchrun --standalone --nproc_per_node=2 examples/train_llama.py --save-strategy best_strategy.json

test: setup
	$(BIN)/ruff check atorch tests examples benchmarks
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
