"""Loss comparisons between a distributed run and its single-process reference."""

import math

import torch

FP32_RTOL = 1e-5
BF16_RTOL = 5e-3


def assert_losses_close(actual, expected, rtol):
    assert len(actual) == len(expected) and len(expected) >= 5
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert math.isfinite(a), f"step {step}: loss {a}"
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs reference {e} (rtol {rtol})\n{actual}\n{expected}"


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
