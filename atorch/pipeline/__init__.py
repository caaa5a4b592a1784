"""Pipeline parallelism: a model split into stages over ranks, microbatches run by a schedule."""

from atorch.pipeline.layouts import Layout, register_layout
from atorch.pipeline.model import PipelineModel

__all__ = ["Layout", "PipelineModel", "register_layout"]
