"""A search resolves every candidate (for its estimate and again for its dry run): a method
dropped for changing nothing was logged each time (module_replace 8 times in one search of the
README example, issue 36); inside a search (engine.search runs in plan.each_drop_once) it is
logged once."""

import pytest

from tests.conftest import messages

pytest.importorskip("transformers")

DROP = "module_replace: dropped because it would change nothing"


def test_each_drop_once_logs_a_repeated_drop_once(atorch_logs):
    """(atorch_logs is the caplog of the atorch logger, which does not propagate to the root.)"""
    from atorch.auto.plan import each_drop_once, resolve_strategy
    from atorch.auto.strategy import Strategy
    from tests.helpers.hf import tiny_llama

    model = tiny_llama()  # sdpa already: module_replace would change nothing
    with each_drop_once():
        for _ in range(3):
            assert resolve_strategy(model, Strategy(["module_replace"])).opt_names == []
    inside = messages(atorch_logs).count(DROP)
    resolve_strategy(model, Strategy(["module_replace"]))  # outside a search: each call says it
    assert inside == 1 and messages(atorch_logs).count(DROP) == 2
