"""The schedules atorch offers, the torch.distributed.pipelining class behind each, and where
each stage lives.

- ``"gpipe"``: all forwards, then all backwards (one stage per rank).
- ``"1f1b"``: one forward, one backward in the steady state (one stage per rank); less
  activation memory than GPipe for the same bubble.
- ``"interleaved"``: interleaved 1F1B over ``virtual_pipeline_size`` stages per rank (stage
  ``s`` on rank ``s % pipeline_size``); the bubble shrinks by the number of local stages.
- ``"zero_bubble"``: torch's interleaved zero-bubble schedule (ZB1P), backward split into input
  and weight gradients so the weight part fills the bubble; any ``virtual_pipeline_size``.
- ``"zbv"``: torch's ZB-V schedule: exactly two stages per rank placed in a V (rank ``r`` holds
  stages ``r`` and ``2 * pipeline_size - 1 - r``).
"""

import torch

from atorch.errors import MethodConfigError

# The torch.distributed.pipelining class of each, by name: that package imports torch._dynamo
# (0.5 s), imported in build_schedule, not when the method registry loads.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
# Schedules whose torch class takes one stage, not a list.
SINGLE_STAGE = ("gpipe", "1f1b")


def check_schedule(schedule: str, virtual_pipeline_size: int) -> str:
    """The schedule that runs: ``"1f1b"`` with ``virtual_pipeline_size > 1`` becomes ``"interleaved"``;
    impossible combinations raise :class:`MethodConfigError`."""
    if schedule not in SCHEDULES:
        raise MethodConfigError(f"unknown pipeline schedule {schedule!r}; pick one of {sorted(SCHEDULES)}")
    if virtual_pipeline_size < 1:
        raise MethodConfigError(f"virtual_pipeline_size is {virtual_pipeline_size}; it must be at least 1")
    if schedule == "1f1b" and virtual_pipeline_size > 1:
        return "interleaved"
    if schedule == "gpipe" and virtual_pipeline_size > 1:
        raise MethodConfigError(
            "schedule 'gpipe' runs one stage per rank; use schedule 'interleaved' (or 'zero_bubble') with "
            f"virtual_pipeline_size={virtual_pipeline_size}, or set virtual_pipeline_size=1"
        )
    if schedule == "zbv" and virtual_pipeline_size != 2:
        raise MethodConfigError(f"schedule 'zbv' holds exactly two stages per rank; set virtual_pipeline_size=2, "
                                f"not {virtual_pipeline_size}")
    return schedule


def local_stage_indices(schedule: str, pp_rank: int, pp_size: int, virtual_pipeline_size: int) -> list[int]:
    """The global stage indices this pipeline rank runs, in the order the schedule expects."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(virtual_pipeline_size)]


def build_schedule(schedule: str, stages: list, num_microbatches: int, loss_fn):
    """The torch schedule object over this rank's ``PipelineStage`` objects."""
    from torch.distributed import pipelining

    cls = getattr(pipelining, SCHEDULES[schedule])
    # scale_grads=False: PipelineModel weighs each microbatch's loss by what it counts and scales
    # the gradients by the whole batch's count after the step (atorch/loss), which a division by
    # the number of microbatches would undo.
    try:
        if schedule in SINGLE_STAGE:
            return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as error:  # torch's own checks (e.g. 1F1B needs at least as many microbatches as stages)
        raise MethodConfigError(f"schedule {schedule!r} with {num_microbatches} microbatches: {error}; change "
                                "num_microbatches or the schedule") from None


def deallocate_after_send(stage) -> None:
    """Free a stage's forward output once its send to the next stage is posted
    (``deallocate_pipeline_outputs=True``, Megatron's ``deallocate_output_tensor``).

    torch's schedules keep each microbatch's output until its backward, only for its autograd
    node: the backward reads the gradient received from the next stage, never the output's
    values. The output's storage is swapped for one element expanded to the same shape (the
    shape autograd checks); the send holds its own alias of the old storage, which is freed once
    the send completes. Only a stage with one output is freed, and that output must not be used
    again inside the stage (its last op's result, as in a chain of blocks).
    """
    original = stage.get_fwd_send_ops

    def get_fwd_send_ops(fwd_chunk_id: int):
        ops = original(fwd_chunk_id)
        outputs, _ = stage.fwd_cache[fwd_chunk_id]
        if ops and len(outputs) == 1:
            out = outputs[0]
            if isinstance(out, torch.Tensor) and out.grad_fn is not None and out.numel() > 1:
                out.data = torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)
        return ops

    stage.get_fwd_send_ops = get_fwd_send_ops
