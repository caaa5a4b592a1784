"""How a model's forward splits into a chain of units that pipeline stages can run in turn.

A layout names the model's units in forward order (the places a stage boundary may fall are
between two units), builds the module that runs a contiguous range of them, and turns the last
stage's output back into what the whole model's ``forward`` returns. Two layouts are built in:

- :class:`SequentialLayout` for ``nn.Sequential`` models: each child is a unit (an
  ``nn.ModuleList`` child is opened into its items); the forward is the chain itself.
- :class:`DecoderLMLayout` for Hugging Face decoder language models built like Llama
  (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``:
  Llama, Mistral, Qwen2, ...): units are the embedding, each decoder layer, the final norm and
  the head; a batch's ``attention_mask`` (padded or not) enters the first stage and is handed on
  with the hidden states, each stage builds the 4D mask from it and the rotary embeddings from the
  hidden states' shape, as the model's forward does, and the last stage computes the loss with the
  model's own ``loss_function``.

Other models are split by tracing their forward (:mod:`atorch.pipeline.traced`, see
:func:`layout_for`); :func:`register_layout` adds a fast path for a model family of your own.
"""

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from atorch.errors import NotSupportedError


class Layout:
    """The chain of units of one model; subclasses fill in how a range of units runs."""

    # True for the general path: stages cut from a trace of the forward (atorch.pipeline.traced).
    traced = False

    def __init__(self, model: nn.Module, units: list[str], layer_units: list[str], inputs: list[str]):
        self.model = model
        # Dotted module names in forward order.
        self.units = units
        # The units that are transformer layers (auto_partition balances these).
        self.layer_units = layer_units
        # The forward kwargs the first stage consumes; the others go to the loss on the last stage.
        self.inputs = inputs
        # The kwargs the loss takes (set per batch by the DeepSpeed path).
        self.targets: list[str] = []

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def stage_module(self, names: list[str], is_first: bool, is_last: bool) -> nn.Module:
        """The module that runs ``names``; it holds them, in order, in an ``nn.ModuleList`` named ``units``."""
        raise NotImplementedError

    def model_output(self, stage_output: Any, targets: dict[str, Any]) -> Any:
        """What the whole model's forward would return, from the last stage's output."""
        return stage_output

    def prepare_batch(self, batch: dict) -> dict:
        """The batch this layout runs (the traced layout learns its inputs from it here)."""
        return batch

    def check_kwargs(self, names: list[str]) -> None:
        """Raise for forward kwargs this layout cannot honour (on every rank, before the schedule
        starts, so no rank is left waiting for one that failed)."""

    def materialize_shared(self, device: torch.device) -> None:
        """Rebuild the modules every stage uses (buffers only) after a meta-device build."""


class _Chain(nn.Module):
    def __init__(self, units: list[nn.Module]):
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, x):
        for unit in self.units:
            x = unit(x)
        return x


class SequentialLayout(Layout):
    """``nn.Sequential`` models; the first kwarg (or ``input_names[0]``) is the chain's input."""

    def __init__(self, model: nn.Sequential, input_names: list[str] | None):
        units = []
        for name, child in model.named_children():
            if isinstance(child, nn.ModuleList):
                units += [f"{name}.{i}" for i in range(len(child))]
            else:
                units.append(name)
        super().__init__(model, units, list(units), list(input_names or [])[:1])

    def stage_module(self, names, is_first, is_last):
        return _Chain([self.module(n) for n in names])


class _DecoderStage(nn.Module):
    def __init__(self, layout: "DecoderLMLayout", names: list[str], is_last: bool = False):
        super().__init__()
        self.layout = [layout]  # a list: the layout holds the whole model, which is no child of this stage
        self.kinds = [layout.kind(n) for n in names]
        self.units = nn.ModuleList(layout.module(n) for n in names)
        self.is_last = is_last
        # the parts of the sequence the hidden states arrive in: mixed_parallel's sequence
        # parallelism hands a stage after the first block one tensor rank's chunk of it
        self.sequence_parts = 1

    def forward(self, x, attention_mask=None):
        # A padding mask travels with the hidden states (the next stage builds its 4D mask from it).
        context = None
        for kind, unit in zip(self.kinds, self.units):
            if kind == "layer":
                if context is None:
                    context = self.layout[0].layer_context(x, attention_mask, self.sequence_parts)
                x = unit(x, **context)
            else:
                x = unit(x)
        return x if attention_mask is None or self.is_last else (x, attention_mask)

    # tensor_parallel's shard_model asks these to split the embedding and the head.
    def get_input_embeddings(self):
        return next((u for k, u in zip(self.kinds, self.units) if k == "embed"), None)

    def get_output_embeddings(self):
        return next((u for k, u in zip(self.kinds, self.units) if k == "head"), None)


class DecoderLMLayout(Layout):
    """Hugging Face causal LMs built like Llama; takes ``input_ids``, ``attention_mask`` (padding
    allowed) and ``labels``."""

    def __init__(self, model: nn.Module):
        base = model.model
        layers = [f"model.layers.{i}" for i in range(len(base.layers))]
        super().__init__(model, ["model.embed_tokens", *layers, "model.norm", "lm_head"], layers, ["input_ids"])
        # An attention_mask enters the first stage and is handed on with the hidden states; False
        # where stages pass one tensor (DeepSpeed's engine): a mask of ones is dropped, padding refused.
        self.route_mask = True

    @staticmethod
    def matches(model: nn.Module) -> bool:
        base = getattr(model, "model", None)
        return all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and isinstance(
            getattr(model, "lm_head", None), nn.Module) and hasattr(model, "loss_function")

    def kind(self, name: str) -> str:
        return {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "head"}.get(name, "layer")

    def stage_module(self, names, is_first, is_last):
        return _DecoderStage(self, names, is_last)

    def layer_context(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, parts: int = 1) -> dict:
        """The layers' keyword arguments for ``hidden``: the causal mask, positions and rotary
        embeddings of the whole sequence, also where ``hidden`` holds one of its ``parts`` (a
        sequence-parallel chunk; each layer gathers the whole sequence before attention)."""
        from transformers.masking_utils import create_causal_mask

        base = self.model.model
        if parts > 1:  # the whole sequence's shape, without its memory (only shape, dtype and device are read)
            hidden = hidden[:, :1].expand(hidden.shape[0], hidden.shape[1] * parts, hidden.shape[2])
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40)
        cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
        # as the model's forward builds it: positions 0..n-1 whatever the padding
        mask = create_causal_mask(config=base.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  position_ids=position_ids, **{cache: None})
        return {"attention_mask": mask, "position_ids": position_ids,
                "position_embeddings": base.rotary_emb(hidden, position_ids=position_ids)}

    def prepare_batch(self, batch):
        mask = batch.get("attention_mask")
        # every batch of a job has a mask or none: the stages' arguments stay the same from step to step
        routed = isinstance(mask, torch.Tensor) and self.route_mask
        self.inputs = ["input_ids", "attention_mask"] if routed else ["input_ids"]
        if isinstance(mask, torch.Tensor) and not routed and not mask.is_meta and bool((mask == 1).all()):
            # no padding: the causal mask each stage builds is the same
            batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        return batch

    def check_kwargs(self, names):
        unknown = sorted(set(names) - {"input_ids", "labels", *self.inputs})
        if unknown:
            mask = "" if self.route_mask else (", a padding attention_mask (with zeros) needs pipeline_parallel's "
                                               "PipelineModel, which passes it between stages")
            raise NotSupportedError(
                f"{type(self.model).__name__} is pipelined on input_ids, attention_mask and labels only; {unknown} "
                f"are not passed between stages (custom position_ids would be ignored{mask}); drop them"
            )

    def model_output(self, stage_output, targets):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self.check_kwargs(list(targets))
        labels = targets.get("labels")
        loss = None
        if labels is not None:
            loss = self.model.loss_function(logits=stage_output, labels=labels, vocab_size=self.model.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=stage_output)

    def materialize_shared(self, device):
        rotary = self.model.model.rotary_emb
        fresh = type(rotary)(config=rotary.config, device=device) if _takes_device(type(rotary)) else type(rotary)(
            config=rotary.config)
        self.model.model.rotary_emb = fresh.to(device)


def _takes_device(cls) -> bool:
    import inspect

    return "device" in inspect.signature(cls.__init__).parameters


_LAYOUTS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module, list[str] | None], Layout]]] = []


def register_layout(matches: Callable[[nn.Module], bool], build: Callable[[nn.Module, list[str] | None], Layout]):
    """Teach PipelineModel a model family: ``matches(model)`` says whether ``build(model, input_names)``
    (returning a :class:`Layout`) applies. Layouts registered later are tried first."""
    _LAYOUTS.insert(0, (matches, build))


register_layout(lambda m: isinstance(m, nn.Sequential), SequentialLayout)
register_layout(DecoderLMLayout.matches, lambda m, names: DecoderLMLayout(m))


def is_decoder_lm(model: nn.Module) -> bool:
    """Whether :func:`layout_for` splits ``model`` as a Llama-style decoder LM (DecoderLMLayout is
    the first registered layout that matches it), without building the layout: the one answer for
    every caller that asks (mixed_parallel's sequence parallelism runs only there)."""
    matches = next((matches for matches, _ in _LAYOUTS if matches(model)), None)
    return matches is DecoderLMLayout.matches


def layout_for(model: nn.Module, input_names: list[str] | None = None, layer_cls: type | None = None,
               leaf_cls: list | tuple | None = None) -> Layout:
    """How PipelineModel splits ``model``: a registered layout where one matches (the fast path),
    else by tracing the forward (:class:`atorch.pipeline.traced.TracedLayout`); a model that
    cannot be split at its submodules raises :class:`NotSupportedError`."""
    for matches, build in _LAYOUTS:
        if matches(model):
            return build(model, input_names)
    from atorch.pipeline.traced import TracedLayout

    return TracedLayout(model, input_names, layer_cls, tuple(leaf_cls or ()))
