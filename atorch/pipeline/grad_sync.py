"""The data ranks' sum of a pipeline rank's gradients, started inside the schedule.

Once a stage has run backward for its last microbatch, its gradients are final for the step (the
sum of a tied weight over pipeline ranks comes later, and sums commute). :class:`GradSync` starts
their all-reduce over the data ranks there, bucket by bucket as that backward fills them, without
waiting; :class:`~atorch.pipeline.model.PipelineModel` waits for the sums after the schedule. The
collectives so run behind the rest of the rank's backward: the layers that last backward has not
reached yet, and the later microbatches of its other stages (an interleaved schedule finishes its
deepest stage first).

Buckets (:func:`bucket_layout`): a stage's parameters in reverse order, the order backward reaches
them. A gradient of ``bucket_bytes`` or more is summed alone, in place; smaller ones of one dtype
are packed into a flat buffer of up to ``bucket_bytes``, which lives from its start to the step's
end: the only memory the sync adds. A stage's buckets start strictly in order, each when every
gradient in it is final, so the data ranks of a stage issue the same collectives in the same order
whatever order their backward takes. A parameter two local stages use, and the stages of a traced
model (built by torch, without the hook), are summed after the schedule.

A gradient that is ``None`` is left out of its bucket, as the sum after the schedule always left
it: every data rank of a stage must then agree on which are (a parameter no rank's batch reached).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from atorch.sharding.fsdp2 import held_per_rank

# Gradients smaller than this are packed together; larger ones are summed alone, in place
# (DDP packs every gradient into 25 MiB buckets, which doubles the gradients' memory).
BUCKET_BYTES = 2**20


def summed_params(modules) -> list:
    """The parameters of ``modules`` the data ranks sum, once each in registration order: the
    trainable ones, less expert_parallel's slices (each rank's own, averaged by their method)."""
    params = {id(p): p for module in modules for p in module.parameters() if p.requires_grad and not held_per_rank(p)}
    return list(params.values())


def bucket_layout(params: list, bucket_bytes: int = BUCKET_BYTES) -> list[list]:
    """``params`` (in registration order) as buckets, in the order backward completes them:
    reversed, each large one alone, small ones of a dtype packed up to ``bucket_bytes`` and placed
    where their last member (the earliest parameter) becomes final."""
    placed: list[tuple[int, list]] = []  # (position of its last member in backward's order, bucket)
    open_: dict = {}  # dtype -> (its packed bucket, bytes, position of its last member)
    for position, param in enumerate(reversed(params)):
        size = param.numel() * param.element_size()
        if size >= bucket_bytes:
            placed.append((position, [param]))
            continue
        packed, used, last = open_.get(param.dtype, ([], 0, position))
        if packed and used + size > bucket_bytes:
            placed.append((last, packed))
            packed, used = [], 0
        open_[param.dtype] = (packed + [param], used + size, position)
    placed.extend((last, packed) for packed, _, last in open_.values() if packed)
    return [bucket for _, bucket in sorted(placed, key=lambda item: item[0])]


def packed_bytes(buckets: list[list]) -> int:
    """The bytes of the flat buffers ``buckets`` need (those holding more than one gradient)."""
    return sum(p.numel() * p.element_size() for bucket in buckets if len(bucket) > 1 for p in bucket)


@dataclass
class _Bucket:
    params: list
    pending: int = 0
    work: object = None
    flat: torch.Tensor | None = None
    grads: list = field(default_factory=list)


class GradSync:
    """Sums a pipeline rank's gradients over ``group`` (the data ranks), each stage's as its last
    backward fills them. ``stages``: global stage index -> that stage's parameters, in registration
    order; ``late``: parameters summed after the schedule (shared by two local stages)."""

    def __init__(self, stages: dict[int, list], late: list, group, bucket_bytes: int = BUCKET_BYTES):
        self.group = group
        self.order = list(stages)
        self.buckets = {stage: [_Bucket(b) for b in bucket_layout(params, bucket_bytes)]
                        for stage, params in stages.items()}
        self.late = [_Bucket(b) for b in bucket_layout(late, bucket_bytes)]
        self.where = {id(p): (stage, i) for stage, buckets in self.buckets.items()
                      for i, bucket in enumerate(buckets) for p in bucket.params}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                        for buckets in self.buckets.values() for bucket in buckets for p in bucket.params]
        self.started: list[_Bucket] = []
        self.next: dict[int, int] = {}
        # buckets started inside the last step's schedule, and of those, by backward's hooks
        self.early = self.hooked = 0

    def begin(self) -> None:
        """A new step: nothing started."""
        self.started, self.next, self.early, self.hooked = [], {}, 0, 0

    def arm(self, stage: int) -> None:
        """``stage`` starts the backward of its last microbatch: its gradients are final as it reaches them."""
        self.next[stage] = 0
        for bucket in self.buckets[stage]:
            bucket.pending = len(bucket.params)

    def stage_done(self, stage: int) -> None:
        """``stage``'s last backward has run: start what its backward's hooks did not."""
        self._start_rest(stage)
        self.early = len(self.started)

    def finish(self, factor: float) -> set[int]:
        """Start what is left, wait for every sum, and multiply it by ``factor``; the ids of the
        parameters whose gradients are done."""
        for stage in self.order:  # those never armed too (a traced model's stages)
            self._start_rest(stage)
        for bucket in self.late:
            self._start(bucket)
        done: set[int] = set()
        for bucket in self.started:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.flat is not None:
                offset = 0
                for grad in bucket.grads:
                    grad.copy_(bucket.flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
            for grad in bucket.grads:
                grad.mul_(factor)
            done.update(id(p) for p in bucket.params)
            bucket.work, bucket.flat, bucket.grads = None, None, []
        self.started, self.next = [], {}
        return done

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _on_grad(self, param) -> None:
        where = self.where.get(id(param))
        if where is None or where[0] not in self.next:
            return  # not in a stage's last backward
        stage, index = where
        self.buckets[stage][index].pending -= 1
        buckets = self.buckets[stage]
        while self.next[stage] < len(buckets) and buckets[self.next[stage]].pending <= 0:
            self._start_next(stage)
            self.hooked += 1

    def _start_rest(self, stage: int) -> None:
        """Start ``stage``'s buckets not started yet, in order."""
        self.next.setdefault(stage, 0)
        while self.next[stage] < len(self.buckets[stage]):
            self._start_next(stage)

    def _start_next(self, stage: int) -> None:
        self._start(self.buckets[stage][self.next[stage]])
        self.next[stage] += 1

    def _start(self, bucket: _Bucket) -> None:
        bucket.grads = [p.grad for p in bucket.params if p.grad is not None]
        self.started.append(bucket)
        if not bucket.grads:
            return
        if len(bucket.params) == 1:
            bucket.work = dist.all_reduce(bucket.grads[0], group=self.group, async_op=True)
            return
        bucket.flat = torch.cat([grad.reshape(-1) for grad in bucket.grads])
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
