"""The original (antgroup) ATorch's names on atorch, for code that migrates with its imports changed.

    import atorch; atorch.init_distributed("nccl")          ->  from atorch.compat import antgroup as atorch
    from atorch.auto import auto_accelerate                 ->  from atorch.compat.antgroup import auto_accelerate
    from atorch.auto.accelerate import get_strategy, save_strategy
                                                            ->  from atorch.compat.antgroup import get_strategy, save_strategy
    from atorch.distributed.distributed import create_parallel_group, parallel_group, ...
                                                            ->  from atorch.compat.antgroup.distributed import ...

What differs and what is refused: docs/migrating.md.
"""

from atorch.compat.antgroup.auto import auto_accelerate
from atorch.compat.antgroup.bf16_optimizer import BF16Optimizer
from atorch.compat.antgroup.distributed import (
    coworker_size,
    create_parallel_group,
    init_distributed,
    is_coworker,
    local_rank,
    parallel_group,
    parallel_group_size,
    parallel_instance_index,
    parallel_instance_num,
    parallel_rank,
    rank,
    reset_distributed,
    world_size,
)
from atorch.compat.antgroup.strategy import Strategy
from atorch.compat.antgroup.strategy_io import get_strategy, read_pickled_strategy, save_strategy
from atorch.distributed.env import device

__all__ = [
    "BF16Optimizer",
    "Strategy",
    "auto_accelerate",
    "coworker_size",
    "create_parallel_group",
    "device",
    "get_strategy",
    "init_distributed",
    "is_coworker",
    "local_rank",
    "parallel_group",
    "parallel_group_size",
    "parallel_instance_index",
    "parallel_instance_num",
    "parallel_rank",
    "rank",
    "read_pickled_strategy",
    "reset_distributed",
    "save_strategy",
    "world_size",
]
