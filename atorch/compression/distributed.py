"""Spreading g-nets over ranks: who owns which, and the bucketed collectives between owners and all.

Every rank runs the same deterministic code on the same shapes, so all ranks agree on the owners
and on the order of collectives without talking to each other.
"""

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist


def assign_owners(costs: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Greedy largest-first: each g-net (by cost, largest first, then by name) goes to the rank
    with the least cost so far (the lowest such rank on a tie).

    >>> assign_owners({"a": 8, "b": 5, "c": 4, "d": 1}, 2)
    {'a': 0, 'b': 1, 'c': 1, 'd': 0}
    """
    load = [0] * world_size
    owners = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += costs[name]
    return {name: owners[name] for name in costs}


def buckets(names: Iterable[str], numels: Mapping[str, int], cap: int) -> list[list[str]]:
    """``names`` in order, grouped so that each group holds at most ``cap`` elements (a single
    larger tensor gets a group of its own)."""
    groups: list[list[str]] = []
    size = cap + 1
    for name in names:
        if size + numels[name] > cap or not groups:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += numels[name]
    return groups


class OwnerComm:
    """The collectives of one process group, bucketed per owner.

    ``group`` is a process group, or ``None`` for a single process (no communication).
    """

    def __init__(self, group: dist.ProcessGroup | None, bucket_numel: int):
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.bucket_numel = bucket_numel

    def _plan(self, owners: Mapping[str, int], numels: Mapping[str, int]) -> list[tuple[int, list[str]]]:
        plan = []
        for owner in range(self.world_size):
            mine = [name for name in owners if owners[name] == owner]
            plan += [(owner, bucket) for bucket in buckets(mine, numels, self.bucket_numel)]
        return plan

    def broadcast_from_owners(self, values: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor],
                              owners: Mapping[str, int]) -> None:
        """Copy each owner's ``values[name]`` into ``targets[name]`` on every rank.

        ``values`` holds the tensors this rank owns; one flat buffer per bucket goes out from
        its owner, all buckets in flight at once.
        """
        with torch.no_grad():
            for name, value in values.items():
                targets[name].copy_(value)
            if self.world_size == 1:
                return
            numels = {name: t.numel() for name, t in targets.items()}
            pending = []
            for owner, names in self._plan(owners, numels):
                if owner == self.rank:
                    flat = torch.cat([values[n].detach().reshape(-1).to(targets[n].dtype) for n in names])
                else:
                    first = targets[names[0]]
                    flat = torch.empty(sum(numels[n] for n in names), dtype=first.dtype, device=first.device)
                work = dist.broadcast(flat, group=self.group, group_src=owner, async_op=True)
                pending.append((work, owner, names, flat))
            for work, owner, names, flat in pending:
                work.wait()
                if owner != self.rank:
                    for name, piece in zip(names, flat.split([numels[n] for n in names])):
                        targets[name].copy_(piece.view_as(targets[name]))

    def mean_to_owners(self, grads: Mapping[str, torch.Tensor | None], owners: Mapping[str, int],
                       like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mean over ranks of each ``grads[name]`` (``None`` counts as zeros), delivered to
        its owner only; returns the means of the names this rank owns."""
        mine = [name for name in owners if owners[name] == self.rank]
        if self.world_size == 1:
            return {name: grads[name] if grads[name] is not None else torch.zeros_like(like[name]) for name in mine}
        numels = {name: t.numel() for name, t in like.items()}
        pending = []
        for owner, names in self._plan(owners, numels):
            flat = torch.cat([
                (grads[n] if grads[n] is not None else torch.zeros_like(like[n])).reshape(-1) for n in names
            ])
            work = dist.reduce(flat, group=self.group, group_dst=owner, op=dist.ReduceOp.SUM, async_op=True)
            pending.append((work, owner, names, flat))
        means = {}
        for work, owner, names, flat in pending:
            work.wait()
            if owner == self.rank:
                flat /= self.world_size
                for name, piece in zip(names, flat.split([numels[n] for n in names])):
                    means[name] = piece.view_as(like[name])
        return means
