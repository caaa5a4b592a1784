"""destroy_groups: a mesh rebuilt over the same ranks after its groups were destroyed works.

DTensor memoizes op shardings keyed by specs whose meshes compare equal across process groups;
without clearing the memo, the second mesh's op outputs carried the first mesh's dead group, and
their next collective failed with "Could not resolve the process group registered under the name
N" (a second search in one process hit it on amp_native + checkpoint + zero2)."""

import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _two_lifetimes():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from atorch.distributed.env import destroy_groups

    out = []
    for _ in range(2):
        group = dist.new_group([0, 1])  # not the default group: destroyed below, as a dry run's are
        mesh = DeviceMesh.from_group(group, "cpu")
        x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        y = (x * 2).sum(dim=1)  # its output spec is memoized by the first lifetime
        out.append(y.full_tensor().tolist())  # a collective on the output's mesh
        destroy_groups(mesh.get_all_groups())
    return out


def test_a_second_mesh_over_the_same_ranks_runs_after_destroy_groups():
    results = run_distributed(_two_lifetimes, 2, timeout_s=120)
    expected = [2.0, 10.0, 18.0, 26.0]
    assert results[0] == results[1] == [expected, expected]
