"""pipeline_parallel: the model split into stages over the ``pipeline`` dim, microbatches run by a
torch.distributed.pipelining schedule (see docs/pipeline.md for the training loop).

Config forms: ``("pipeline_parallel", {"num_microbatches": 4, "schedule": "1f1b"})`` with
``("parallel_mode", ([("pipeline", 2), ("data", N)], None))``. Splits nn.Sequential models and
Llama-style Hugging Face decoder LMs (atorch/pipeline/layouts.py); data parallelism over the data
dims is done by the pipeline model itself (no DDP wrapper).
"""

import torch

from atorch.auto.context import ModelContext
from atorch.auto.registry import MethodSpec, Stage, register_method
from atorch.pipeline.auto import PipelineFields, check_fields, pipeline_model
from atorch.pipeline.layouts import layout_for


class PipelineParallelConfig(PipelineFields):
    pass


def resolve(model: torch.nn.Module, config: PipelineParallelConfig) -> PipelineParallelConfig:
    check_fields(config)
    layout_for(model)  # a model it cannot split is an error before anything runs
    return config


def split(ctx: ModelContext, config: PipelineParallelConfig) -> None:
    pipeline_model(ctx, config, "pipeline_parallel")


register_method(
    MethodSpec(
        name="pipeline_parallel",
        config_cls=PipelineParallelConfig,
        hooks={Stage.REWRITE: split},
        description="pipeline parallelism: stages over the pipeline dim, microbatch schedules (1F1B, interleaved...)",
        distributed_only=True,
        uses_dims=("pipeline",),
        needs_dims=("pipeline",),
        conflicts={
            **dict.fromkeys(("fsdp", "zero1", "zero2"), "the pipeline model averages its stages' gradients over the "
                            "data ranks itself; the sharding wrappers expect the whole model on every rank"),
            **dict.fromkeys(("tensor_parallel", "sequence_parallel"), "tensor x pipeline is mixed_parallel; use it"),
        },
        resolve=resolve,
    )
)
