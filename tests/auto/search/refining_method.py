"""A registered method the search tries on its pick (``tried_on_pick``), for testing refine.py:
``_wakes`` takes a nap out of every forward of :class:`NappingTransformer` (the trial runs
clearly faster than the pick), ``_naps`` puts one in (clearly slower); ``_idles`` (as fast) and
``_naps_free`` (clearly slower) are kept unless slower, as the fused step is."""

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


# The nap each method leaves in every forward, and whether it is kept unless slower (as the fused step).
METHODS = {"_wakes": (0.0, False), "_naps": (3 * NAP, False), "_idles": (NAP, True), "_naps_free": (3 * NAP, True)}


def register(name: str) -> None:
    """One of METHODS, registered once per process."""
    try:
        get_method(name)
        return
    except ValueError:
        pass
    nap, unless_slower = METHODS[name]
    register_method(MethodSpec(name, MethodConfig, {Stage.REWRITE: _set_nap(nap)}, "changes the nap", search_space=({},),
                               tried_on_pick=True, kept_unless_slower=unless_slower))
