"""The original ATorch's module path ``atorch.distributed.distributed``, so its code imports unchanged.

    from atorch.distributed.distributed import create_parallel_group, parallel_group, parallel_rank

The names live in :mod:`atorch.compat.antgroup.distributed` (what each does and what differs is
written there and in docs/migrating.md). ``init_distributed`` here is ATorch's (its argument
order, True in a plain single process), not :func:`atorch.init_distributed`.
"""

from atorch.compat.antgroup.distributed import (  # noqa: F401 - re-exported under ATorch's path
    backend,
    coworker_num_per_node,
    coworker_size,
    create_parallel_group,
    create_sequence_parallel_group,
    destroy_parallel_group,
    destroy_sequence_parallel_group,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_size,
    init_distributed,
    is_coworker,
    is_distributed,
    local_rank,
    nproc_per_node,
    parallel_config,
    parallel_group,
    parallel_group_and_ranks,
    parallel_group_size,
    parallel_instance_index,
    parallel_instance_num,
    parallel_rank,
    rank,
    reset_distributed,
    seq_all_to_all,
    use_coworker,
    world_size,
)
