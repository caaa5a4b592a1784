"""ATorch's ``atorch.auto.strategy.Strategy``: a list of ``(name, config, tunable)`` items.

    from atorch.auto.strategy import Strategy  ->  from atorch.compat.antgroup import Strategy

It keeps ATorch's items as given (``opt_list``) and ATorch's methods on them; ``to_atorch()``
is the validated atorch Strategy that ``auto_accelerate`` applies. Two strategies are equal when
they hold the same methods in the same order with the same configs as atorch reads them (an
ATorch strategy equals the atorch Strategy it loads as, so ``get_strategy(...) == strategy``
holds after a save/load or pickle round trip); ``tunable`` is not compared (atorch does not
tune single items, see docs/migrating.md).
"""

import pickle

from atorch.auto.strategy import Strategy as AtorchStrategy


class Strategy:
    """ATorch's Strategy record (see the module).

    Example::

        strategy = Strategy([("parallel_mode", ([("data", 2)], None), False), ("amp_native", None, False)])
        save_strategy(strategy, "s.json")
        status, loaded = get_strategy("s.json")      # (True, an atorch Strategy equal to it)
    """

    def __init__(self, opt_list=None):
        self.opt_list = [] if opt_list is None else opt_list

    def __len__(self) -> int:
        return len(self.opt_list)

    def __getitem__(self, index):
        return self.opt_list[index]

    def __setitem__(self, index, value) -> None:
        self.opt_list[index] = value

    def add_opt(self, opt) -> None:
        self.opt_list.append(opt)

    def opt_names(self) -> list[str]:
        return [_name(item) for item in self.opt_list]

    def is_tunable(self) -> bool:
        return any(isinstance(item, (tuple, list)) and len(item) > 2 and item[2] for item in self.opt_list)

    def get_parallel_mode(self):
        for item in self.opt_list:
            if _name(item) == "parallel_mode":
                return True, item[1] if isinstance(item, (tuple, list)) and len(item) > 1 else None
        return False, None

    def convert_strategy_to_easydl_format(self) -> list:
        """``[(name, pickled config, tunable)]`` as ATorch gives EasyDL (each config pickled; read
        them back with :func:`atorch.compat.antgroup.read_pickled_strategy`'s restricted unpickler)."""
        out = []
        for item in self.opt_list:
            item = (item, None, None) if isinstance(item, str) else tuple(item) + (None,) * (3 - len(item))
            out.append((item[0], pickle.dumps(item[1]), item[2]))
        return out

    def to_atorch(self) -> AtorchStrategy:
        from atorch.compat.antgroup.strategy_io import atorch_items

        return AtorchStrategy(atorch_items(self.opt_list))

    def __eq__(self, other) -> bool:
        if isinstance(other, Strategy):
            other = other.to_atorch()
        if not isinstance(other, AtorchStrategy):
            return NotImplemented
        return self.to_atorch() == other

    __hash__ = None

    def __str__(self) -> str:
        return f"ATorch strategy of {len(self)} methods: {self.opt_names()}"


def _name(item) -> str:
    return item if isinstance(item, str) else item[0]
