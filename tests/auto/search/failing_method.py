"""A registered method that raises while it is applied, for testing how the search copes."""

import torch.distributed as dist

from atorch.auto.config_types import MethodConfig
from atorch.auto.registry import MethodSpec, Stage, get_method, register_method


class ExplodesConfig(MethodConfig):
    fail_on_rank: int | None = None


def _explode(ctx, config):
    rank = dist.get_rank() if dist.is_initialized() else 0
    if config.fail_on_rank is None or config.fail_on_rank == rank:
        raise RuntimeError(f"boom on rank {rank}")


def register(fail_on_rank=None):
    try:
        get_method("_explodes")
        return
    except ValueError:
        pass
    register_method(MethodSpec("_explodes", ExplodesConfig, {Stage.REWRITE: _explode}, "fails on purpose",
                               search_space=({"fail_on_rank": fail_on_rank},)))
