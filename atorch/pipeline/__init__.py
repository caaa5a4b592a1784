"""Pipeline parallelism: a model split into stages over ranks, microbatches run by a schedule."""

from atorch.utils.lazy import lazy_exports

# Imported on first use: atorch.pipeline.model imports torch.distributed.pipelining (and with it
# torch._dynamo, 0.5 s), which the method registry (`atorch validate`) does not need.
_LAZY = {
    "Layout": "atorch.pipeline.layouts",
    "PipelineModel": "atorch.pipeline.model",
    "PipelineStepError": "atorch.pipeline.failure",
    "pipeline_eligibility": "atorch.pipeline.eligibility",
    "register_layout": "atorch.pipeline.layouts",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["Layout", "PipelineModel", "PipelineStepError", "pipeline_eligibility", "register_layout"]
