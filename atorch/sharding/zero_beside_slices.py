"""zero1 beside expert_parallel: the optimizer state of the shared weights sharded over the data
ranks, each rank stepping its own experts' slices itself.

PyTorch's ``ZeroRedundancyOptimizer`` hands each parameter to one rank, which steps it and then
broadcasts it to the others. An expert slice is a different tensor on every rank of its expert
group (same shape, other experts): stepped on one rank and broadcast, it would overwrite the
other ranks' experts with its own. So the slices are kept out of the partition the ranks share:
each rank's own slices join its own partition (its inner optimizer steps them, with their state),
and no broadcast or parameter bucket carries them. Their gradients are already the average over
their copies (expert_parallel's hooks), so every copy takes the same step.

The partition of the shared weights is ZeRO's own (largest first, to the least loaded rank), and
the user's param groups, their hyperparameters and an LR scheduler's changes work as under
``ZeroRedundancyOptimizer``. ``consolidate_state_dict`` is refused with the reason: one rank
cannot hold the other ranks' experts' state; ``atorch.checkpoint`` saves and loads it.
"""

from torch.distributed.optim import ZeroRedundancyOptimizer

from atorch.errors import NotSupportedError
from atorch.sharding.fsdp2 import held_per_rank as is_slice  # expert_parallel's slice of this rank's experts


class ZeroBesideSlices(ZeroRedundancyOptimizer):
    """A ZeroRedundancyOptimizer whose partition leaves expert_parallel's slices to their own rank
    (see the module's docstring)."""

    def _partition_parameters(self, params_per_rank=None):
        if params_per_rank is not None:
            raise NotSupportedError("zero1 beside expert_parallel partitions the parameters itself")
        if not self._partition_parameters_cache:
            self._partition_parameters_cache = [[] for _ in range(self.world_size)]
            sizes = [0] * self.world_size
            for group in self.param_groups:
                per_rank = [[] for _ in range(self.world_size)]
                shared = sorted((p for p in group["params"] if not is_slice(p)), key=lambda p: p.numel(),
                                reverse=True)
                for param in shared:  # ZeRO's rule: the largest first, to the least loaded rank
                    rank = self._get_min_index(sizes)
                    per_rank[rank].append(param)
                    sizes[rank] += param.numel()
                per_rank[self.rank] += [p for p in group["params"] if is_slice(p)]
                self._partition_param_group(group, per_rank)
        return self._partition_parameters_cache

    @property
    def _device_to_params_per_rank(self):
        """The buckets' parameters: the partition without the slices (each rank's own)."""
        found = ZeroRedundancyOptimizer._device_to_params_per_rank.fget(self)
        return {device: [[p for p in params if not is_slice(p)] for params in per_rank]
                for device, per_rank in found.items()}

    def _broadcast_params_from_rank(self, rank: int):
        if self.parameters_as_bucket_view:
            return super()._broadcast_params_from_rank(rank)
        import torch.distributed as dist

        source = dist.get_global_rank(self.process_group, rank)
        return [dist.broadcast(param.data, src=source, group=self.process_group, async_op=True)
                for group in self._partition_parameters()[rank] for param in group["params"]
                if not is_slice(param)]

    def consolidate_state_dict(self, to: int = 0) -> None:
        raise NotSupportedError(
            "zero1 beside expert_parallel cannot consolidate the optimizer state on one rank: each rank holds "
            "its own experts' state. Save it with atorch.checkpoint.save (each rank writes its share), which "
            "loads under any strategy")
