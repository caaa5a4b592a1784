"""A registered method the search tries on its pick (``tried_on_pick``), for testing refine.py:
``_wakes`` takes a nap out of every forward of :class:`NappingTransformer` (the trial runs
clearly faster than the pick), ``_naps`` puts one in (clearly slower)."""

import time

from atorch.auto.config_types import MethodConfig
from atorch.auto.registry import MethodSpec, Stage, get_method, register_method
from tests.helpers.models import TinyTransformer

NAP = 0.01


class NappingTransformer(TinyTransformer):
    nap = NAP

    def forward(self, input_ids, labels=None):
        time.sleep(self.nap)
        return super().forward(input_ids, labels)


def _set_nap(seconds):
    def hook(ctx, config):
        for module in ctx.model.modules():
            if isinstance(module, NappingTransformer):
                module.nap = seconds
    return hook


def register(name: str) -> None:
    """``_wakes`` or ``_naps``, registered once per process."""
    try:
        get_method(name)
        return
    except ValueError:
        pass
    hook = _set_nap(0.0 if name == "_wakes" else 3 * NAP)
    register_method(MethodSpec(name, MethodConfig, {Stage.REWRITE: hook}, "changes the nap", search_space=({},),
                               tried_on_pick=True))
