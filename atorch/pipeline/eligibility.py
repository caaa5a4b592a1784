"""Whether a model can be split into pipeline stages, asked before anything is built."""

import inspect
from typing import Any

import torch
from torch import nn

from atorch.errors import AtorchConfigError, NotSupportedError
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
        layout = layout_for(model, _forward_names(model, example_inputs))
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


def _forward_names(model: nn.Module, example_inputs: dict[str, Any] | None) -> list[str] | None:
    """The example inputs that are arguments of the forward, in its order: the traced inputs."""
    if not example_inputs:
        return None
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return [name for name in params if name in example_inputs] or None


def _hf_example(model: nn.Module, inputs: list[str]) -> dict | None:
    if inputs != ["input_ids"] or getattr(model, "config", None) is None:
        return None
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotSupportedError(
            f"{type(model).__name__} is an encoder-decoder model: its forward needs decoder inputs and returns the "
            "encoder's last hidden state, which is computed before the last stage and cannot reach the loss. "
            "Fix: wrap it in a module whose forward takes input_ids and decoder_input_ids and returns the logits "
            "only, and give both as input_names (example_inputs here); or keep it off the pipeline (data, "
            "tensor or fsdp layouts)")
    return {"input_ids": torch.zeros(1, 8, dtype=torch.long, device="meta")}
