"""Whether a model can be split into pipeline stages, asked before anything is built."""

from typing import Any

import torch
from torch import nn

from atorch.errors import AtorchConfigError, NotSupportedError
from atorch.pipeline.layouts import layout_for
from atorch.pipeline.partition import balanced_ranges


def pipeline_eligibility(model: nn.Module, stages: int, example_inputs: dict[str, Any] | None = None,
                         input_names: list[str] | None = None) -> str | None:
    """``None`` if ``model`` splits into ``stages`` pipeline stages, else the reason it does not.

    ``stages`` counts every stage (pipeline size x virtual stages per rank). The answer is the
    one ``PipelineModel(model, auto_partition=True, input_names=input_names, ...)`` would give
    when called with ``example_inputs``:

    - a model a layout knows (``nn.Sequential``, Llama-style decoders, registered layouts) needs
      ``stages - 1`` boundaries before its layers, and must take the example's arguments (a
      Llama-style decoder refuses custom ``position_ids``, say);
    - any other model is traced (torch.export on a meta-device copy: no memory, about a second
      for a small model, seconds for a 7B config): the reason names what stops the trace (Python
      control flow on tensor values, with the line) or a forward that runs its modules in another
      order than they are registered in. It is traced with ``example_inputs`` (one microbatch of
      the batch the model will be called with: keyword arguments of the forward, real or meta
      tensors; the tensors the forward takes are the traced inputs, as PipelineModel picks them),
      or, for a Hugging Face model whose main input is ``input_ids``, with a batch of one 8-token
      sequence. Without either, only the module structure is checked.

    The model is not modified. Example::

        from atorch.pipeline import pipeline_eligibility

        batch = {"input_ids": ids[:2], "attention_mask": mask[:2], "labels": labels[:2]}
        reason = pipeline_eligibility(model, 4, batch)
        if reason is not None:
            print("no pipeline layout:", reason)
    """
    if stages < 1:
        return f"stages is {stages}; it must be at least 1"
    try:
        layout = layout_for(model, input_names)
        ranges = balanced_ranges(model, layout.units, layout.layer_units, stages)
        inputs = None
        if example_inputs is not None:
            # what PipelineModel does with the batch before its schedule runs
            inputs = layout.prepare_batch(dict(example_inputs))
            layout.check_kwargs(list(inputs))
        if layout.traced:
            inputs = inputs if inputs is not None else _hf_example(model, layout.inputs)
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
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotSupportedError(
            f"{type(model).__name__} is an encoder-decoder model: its forward needs decoder inputs and returns the "
            "encoder's last hidden state, which is computed before the last stage and cannot reach the loss. "
            "Fix: wrap it in a module whose forward takes input_ids and decoder_input_ids and returns the logits "
            "only, and give both as input_names (example_inputs here); or keep it off the pipeline (data, "
            "tensor or fsdp layouts)")
    return {"input_ids": torch.zeros(1, 8, dtype=torch.long, device="meta")}
