"""What a loss counts: the label tokens of a batch, as the model's own loss counts them.

A Hugging Face model's ``out.loss`` is a mean over the positions whose label is not -100. A
causal LM predicts token t+1 from token t, so it drops each sequence's first label (it pads the
labels with -100 on the right and shifts them by one); a masked LM, a classifier or an
encoder-decoder's decoder counts its labels as they are. A batch that brings ``shift_labels``
(already shifted) is counted as it is.
"""

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LabelRule:
    """How to count the labels a model's loss averages over.

    ``shift``: the loss predicts the next token (a causal LM), so the first label of each
    sequence is not counted.
    """

    shift: bool

    def count(self, batch: Any) -> torch.Tensor | None:
        """The positions this batch's loss counts (a 0-dim int64 tensor), or None without labels."""
        shifted = _field(batch, "shift_labels")
        if shifted is not None:
            return (shifted != IGNORE_INDEX).sum()
        labels = _field(batch, "labels")
        if labels is None:
            return None
        if labels.is_floating_point():  # a regression's targets: a mean over every element
            return torch.tensor(labels.numel(), device=labels.device)
        if self.shift and labels.dim() >= 2:
            labels = labels[..., 1:]
        return (labels != IGNORE_INDEX).sum()


def padded(batch: Any) -> bool:
    """Whether the batch's labels ignore some positions (-100): parts of it weigh differently."""
    labels = _field(batch, "labels")
    return labels is not None and not labels.is_floating_point() and bool((labels == IGNORE_INDEX).any())


def _field(batch: Any, name: str) -> torch.Tensor | None:
    value = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None


def rule_for(model: torch.nn.Module) -> LabelRule | None:
    """The counting rule of a Hugging Face model's own loss; None for a model atorch cannot read.

    Encoder-decoders (T5, BART) count their decoder labels as they are. Otherwise the forward is
    read: one that calls ``self.loss_function`` shifts where that is transformers' causal-LM loss
    (``...ForCausalLM``, ``GPT2LMHeadModel``, vision-language ``...ForConditionalGeneration``);
    one that computes its own loss shifts where it slices its logits or labels by one (``[...,
    :-1`` or a ``shift_`` name): ``BartForCausalLM`` and masked LMs do not.
    """
    model = _user_module(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "loss_function"):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return LabelRule(shift=False)
    loss_type = getattr(model, "loss_type", None)
    return LabelRule(shift=_forward_shifts(type(model), loss_type if isinstance(loss_type, str) else None))


@functools.cache
def _forward_shifts(cls: type, loss_type: str | None) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (a compiled or generated class): the name says
        return cls.__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if "self.loss_function(" in source:
        from transformers.loss.loss_utils import LOSS_MAPPING

        mapped = LOSS_MAPPING.get(loss_type) if loss_type is not None else None
        # transformers falls back to the causal-LM loss where the class names no known loss type
        return mapped is None or mapped is LOSS_MAPPING["ForCausalLM"]
    return "[..., :-1" in source or "shift_" in source


def _user_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP and peft wrappers (``get_base_model``)."""
    model = getattr(model, "module", model)
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model
