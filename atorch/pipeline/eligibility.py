"""Whether a model can be split into pipeline stages, asked before anything is built."""

from typing import Any

import torch
from torch import nn

from atorch.errors import AtorchConfigError
from atorch.pipeline.layouts import layout_for
from atorch.pipeline.partition import balanced_ranges


def pipeline_eligibility(model: nn.Module, stages: int, example_inputs: dict[str, Any] | None = None) -> str | None:
    """``None`` if ``model`` splits into ``stages`` pipeline stages, else the reason it does not.

    ``stages`` counts every stage (pipeline size x virtual stages per rank). The answer is the
    one ``PipelineModel(model, auto_partition=True, ...)`` would give:

    - a model a layout knows (``nn.Sequential``, Llama-style decoders, registered layouts) needs
      ``stages - 1`` boundaries before its layers;
    - any other model is traced (torch.export on a meta-device copy: no memory, about a second
      for a small model, seconds for a 7B config): the reason names what stops the trace (Python
      control flow on tensor values, with the line) or a forward that runs its modules in another
      order than they are registered in. It is traced with ``example_inputs`` (one microbatch,
      keyword arguments of the forward, real or meta tensors), or, for a Hugging Face model
      whose main input is ``input_ids``, with a batch of one 8-token sequence. Without either,
      only the module structure is checked.

    The model is not modified. Example::

        from atorch.pipeline import pipeline_eligibility

        reason = pipeline_eligibility(model, 4)
        if reason is not None:
            print("no pipeline layout:", reason)
    """
    if stages < 1:
        return f"stages is {stages}; it must be at least 1"
    try:
        layout = layout_for(model)
        ranges = balanced_ranges(model, layout.units, layout.layer_units, stages)
        if layout.traced:
            inputs = example_inputs if example_inputs is not None else _hf_example(model, layout.inputs)
            if inputs is not None:
                missing = [name for name in layout.inputs if name not in inputs]
                if missing:
                    return f"example_inputs lacks the traced inputs {missing}"
                layout.trace(tuple(inputs[name] for name in layout.inputs), ranges)
    except AtorchConfigError as error:
        return str(error)
    return None


def _hf_example(model: nn.Module, inputs: list[str]) -> dict | None:
    if inputs != ["input_ids"] or getattr(model, "config", None) is None:
        return None
    return {"input_ids": torch.zeros(1, 8, dtype=torch.long, device="meta")}
