"""Loss comparisons between a distributed run and its single-process reference."""

import math

import torch

# fp32 runs against a whole-batch serial reference: the gradient sums run in another order.
FP32_RTOL = 1e-5
# bf16/fp16 runs against a serial reference of the same precision made to compute like the
# ranks (tests/helpers/models.train_steps: one thread, the global batch cut into the ranks'
# micro-batches, FSDP2's parameter cast emulated with param_dtype). Noise floor, measured: 0.
# amp_native bf16/fp16 under DDP and zero1, half under DDP, amp bf16 under fsdp/zero2, fsdp
# param_dtype=bf16, every file in strategies/ (tiny Llama) and LoRA + checkpoint match their
# reference bit for bit, losses and each rank's own loss. The same reference on 2 threads
# (LayerNorm's weight grads summed in another order) moves bf16 losses by up to 5e-5, and
# clipping sharded grads under fsdp by 1.5e-4: an fp32 rounding difference flips bf16 casts
# later on, so these checks need the exact reference, not a wider tolerance.
# The effects it must catch: fp32 instead of bf16 moves the losses by 2.8e-6 (LoRA) to 3.8e-3
# (tiny transformer 5.8e-5 to 3.1e-4), fp32 instead of fp16 by 8.9e-6; lr=0 by 1.3e-3 or more.
# 5e-7 is about 4 fp32 ulps of a loss near 4.5 and 5x below the smallest effect.
LOW_PRECISION_RTOL = 5e-7


def assert_losses_close(actual, expected, rtol):
    assert len(actual) == len(expected) and len(expected) >= 5
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert math.isfinite(a), f"step {step}: loss {a}"
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs reference {e} (rtol {rtol})\n{actual}\n{expected}"


def assert_sensitive(actual, controls: dict, rtol):
    """Negative controls: ``actual`` must NOT match any control run (the feature off) within ``rtol``.

    Shows that the comparison that passed could have failed: a reference with lr=0, or without
    the feature (fp32 instead of bf16), is further from the run than the tolerance.
    """
    assert controls, "no negative control given"
    for name, control in controls.items():
        try:
            assert_losses_close(actual, control, rtol)
        except AssertionError:
            continue
        raise AssertionError(f"the check cannot tell this run from the control {name!r} at rtol {rtol}:\n"
                             f"{actual}\n{control}")


def assert_ranks_agree(results, reference=None, rtol: float = 0.0):
    """Per-rank quantities, taken before any reduction, are consistent.

    - Parameters that every rank holds whole (``replicated`` in the results, see
      tests/helpers/models.replicated_params) are bit-identical on all ranks: a rank that missed a
      gradient all-reduce or a broadcast ends on other weights.
    - With a serial ``reference`` trained on as many micro-batches as there are data-parallel
      ranks, each rank's own loss (``local_losses``) is the loss of the reference's micro-batch
      that is its share (``data_rank``) within ``rtol``: every rank trained on its own share of
      each batch, as the reference did (ranks of one tensor-parallel group share one).
    At least one of the two must apply (fully sharded models replicate nothing: pass a reference).
    """
    replicated = results[0]["replicated"]
    assert replicated or reference is not None, "nothing per rank to compare: pass a micro-batched reference"
    for rank, result in enumerate(results[1:], 1):
        assert result["replicated"].keys() == replicated.keys(), rank
        for name, tensor in replicated.items():
            assert torch.equal(result["replicated"][name], tensor), f"rank {rank} holds another {name} than rank 0"
    if reference is not None:
        micro = reference["micro_losses"]
        shares = sorted({result["data_rank"] for result in results})
        assert all(len(step) == len(shares) for step in micro), "the reference's micro-batches are not the ranks' shares"
        for result in results:
            assert_losses_close(result["local_losses"], [step[result["data_rank"]] for step in micro], rtol)
