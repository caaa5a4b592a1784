"""The GPU check kit: one command that proves atorch on a CUDA device the day one is lent (issue 41).

    python -m benchmarks.gpu                  # everything, resuming where a cut run stopped
    python -m benchmarks.gpu --budget 540     # at most 9 minutes now; the same command again goes on
    python -m benchmarks.gpu --step tests     # one step: tests, calibrate, bench, estimate
    make gpu-check                            # the same, after make setup

Steps, each a list of units; a unit runs in its own process with its own time limit, and the
state file records every unit as it ends, so a run cut anywhere (a budget, a killed command, a
lost machine) resumes at the first unit not done:

1. ``tests``: the suite's CUDA-marked tests (``pytest -m gpu``), tests/cuda one file a unit, then
   the ones marked elsewhere in tests/;
2. ``calibrate``: ``atorch calibrate`` on this device (one rank), into the run's folder;
3. ``bench``: a ~1.1B-parameter Llama (random weights, synthetic tokens, sequence 2048) trained by
   atorch's strategies (bf16, + checkpoint, + compile, + fp8 where supported), each beside the
   same job written by hand in plain PyTorch: tokens/s, MFU, peak memory;
4. ``estimate``: the cost model's step time and peak for the same jobs on the calibrated profile
   (and on the repository's datasheet profile when this GPU has one), beside the measurement.

Every invocation ends by writing ``benchmarks/results/gpu_<device>_<date>.{json,md}`` (what is
done so far, and what is not) and printing a summary. Without CUDA the command says so and runs
its CPU dry path: the same steps and bookkeeping on a tiny Llama on the CPU, its report in the
run's folder (the test suite runs it: tests/benchmarks/test_gpu_kit.py).
"""
