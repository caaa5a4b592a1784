# Two commands do all set-up on a fresh machine:
#   make example   the main job: a strategy search and a short training run of a small Llama over
#                  2 CPU processes (gloo); prints the report, saves the winner to best_strategy.json
#   make test      the test suite
#   make gpu-check the GPU check (benchmarks/gpu): CUDA tests, a 1B Llama benchmark, calibration and
#                  the cost model's estimate, results in benchmarks/results/gpu_<device>_<date>.{json,md};
#                  resumes a cut run; without CUDA its CPU dry path. Arguments: GPU_CHECK_ARGS="--budget 540"
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch comes from wherever pip is configured to look (index, --find-links, cache): a wheel
# already there is used as is, offline. From PyPI itself, torch for Linux x86_64 is the CUDA
# build (several GB with its nvidia-* wheels); for the CPU-only build name PyTorch's CPU index:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
# constraints.txt pins the optional back-ends to the versions the suite last passed with;
# CONSTRAINTS= installs the newest releases instead.
CONSTRAINTS ?= constraints.txt

GPU_CHECK_ARGS ?=

.PHONY: setup example test gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: setup.py $(CONSTRAINTS) $(BIN)/python
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PIN)
	$(BIN)/pip install --quiet -e ".[dev]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $@

setup: $(VENV)/.installed

example: setup
	$(BIN)/torchrun --standalone --nproc_per_node=2 examples/train_llama.py --save-strategy best_strategy.json

test: setup
	$(BIN)/ruff check atorch tests examples benchmarks
	$(BIN)/python -m pytest tests

gpu-check: setup
	$(BIN)/python -m benchmarks.gpu $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
