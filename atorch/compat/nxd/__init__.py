"""NxD Core (neuronx-distributed) names on atorch: code migrates by changing one import prefix.

    from neuronx_distributed.parallel_layers import parallel_state, ColumnParallelLinear
        ->  from atorch.compat.nxd.parallel_layers import parallel_state, ColumnParallelLinear

The layers take NxD's arguments in NxD's order (``dtype`` before ``init_method``), initialize the
full weight with ``init_method`` and keep this rank's slice, so a layer on N ranks holds exactly
the pieces of the same layer on one rank under the same seed. What differs and what is refused:
docs/migrating.md.
"""

from atorch.compat.nxd import parallel_layers, parallel_state

__all__ = ["parallel_layers", "parallel_state"]
