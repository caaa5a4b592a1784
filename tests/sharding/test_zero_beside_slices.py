"""ZeroBesideSlices on 2 gloo ranks, with and without parameter buckets: the shared weights are
partitioned and broadcast as ZeroRedundancyOptimizer does; a slice (a different tensor on each
rank) is stepped by its own rank and never overwritten by another's."""

import pytest
import torch

from tests.helpers.dist import run_distributed


def _step(bucket_view: bool) -> dict:
    import torch.distributed as dist

    from atorch.sharding.zero_beside_slices import ZeroBesideSlices

    rank = dist.get_rank()
    shared = [torch.nn.Parameter(torch.full((4,), 1.0)), torch.nn.Parameter(torch.full((3,), 2.0))]
    piece = torch.nn.Parameter(torch.full((5,), 10.0 * (rank + 1)))  # this rank's experts
    piece.expert_parallel = True
    for p in shared:
        p.grad = torch.ones_like(p)
    piece.grad = torch.full_like(piece, float(rank + 1))
    optim = ZeroBesideSlices([*shared, piece], optimizer_class=torch.optim.SGD, lr=0.5,
                             parameters_as_bucket_view=bucket_view)
    optim.step()
    refused = None
    try:
        optim.consolidate_state_dict()
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        refused = str(error)
    return {"shared": [p.detach().clone() for p in shared], "piece": piece.detach().clone(), "refused": refused}


@pytest.mark.parametrize("bucket_view", [True, False])
def test_each_rank_steps_its_own_slice_and_shares_the_rest(bucket_view):
    ranks = run_distributed(_step, 2, bucket_view)
    for rank, got in enumerate(ranks):
        assert all(torch.equal(p, torch.full_like(p, value - 0.5)) for p, value in zip(got["shared"], (1.0, 2.0)))
        assert torch.equal(got["piece"], torch.full((5,), 10.0 * (rank + 1) - 0.5 * (rank + 1)))
        assert "atorch.checkpoint" in got["refused"]
