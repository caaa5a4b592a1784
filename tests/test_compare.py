"""The comparison helpers fail where they must (tests/helpers/compare.py)."""

import pytest
import torch

from tests.helpers.compare import assert_ranks_agree, assert_sensitive

LOSSES = [4.0, 3.9, 3.8, 3.7, 3.6]


def _rank(data_rank, local, weight):
    # What every rank logs is the same all-reduced mean; only the per-rank fields can differ.
    return {"losses": LOSSES, "local_losses": local, "data_rank": data_rank,
            "replicated": {"norm.weight": torch.tensor([1.0, weight])}}


def test_ranks_that_drifted_apart_are_caught_though_their_reduced_losses_agree():
    assert_ranks_agree([_rank(0, LOSSES, 2.0), _rank(1, LOSSES, 2.0)])
    with pytest.raises(AssertionError, match="rank 1 holds another norm.weight"):
        assert_ranks_agree([_rank(0, LOSSES, 2.0), _rank(1, LOSSES, 2.0 + 1e-6)])


def test_each_rank_loss_is_checked_against_its_own_micro_batch():
    reference = {"micro_losses": [[a, a + 0.5] for a in LOSSES]}
    ranks = [_rank(0, LOSSES, 2.0), _rank(1, [a + 0.5 for a in LOSSES], 2.0)]
    assert_ranks_agree(ranks, reference, 1e-6)
    swapped = [{**ranks[0], "data_rank": 1}, {**ranks[1], "data_rank": 0}]
    with pytest.raises(AssertionError, match="step 0"):
        assert_ranks_agree(swapped, reference, 1e-6)


def test_nothing_to_compare_is_an_error_not_a_pass():
    fully_sharded = [{**_rank(r, LOSSES, 2.0), "replicated": {}} for r in range(2)]
    with pytest.raises(AssertionError, match="nothing per rank to compare"):
        assert_ranks_agree(fully_sharded)


def test_a_control_the_check_cannot_tell_apart_fails():
    assert_sensitive(LOSSES, {"lr=0": [4.0] * 5}, 1e-3)
    with pytest.raises(AssertionError, match="cannot tell this run from the control 'lr=0'"):
        assert_sensitive(LOSSES, {"lr=0": [a * (1 + 1e-4) for a in LOSSES]}, 1e-3)
