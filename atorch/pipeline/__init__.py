"""Pipeline parallelism: a model split into stages over ranks, microbatches run by a schedule."""

from atorch.pipeline.eligibility import pipeline_eligibility
from atorch.pipeline.layouts import Layout, register_layout
from atorch.pipeline.model import PipelineModel

__all__ = ["Layout", "PipelineModel", "pipeline_eligibility", "register_layout"]
