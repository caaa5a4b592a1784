"""A search resolves every candidate (for its estimate and again for its dry run): a method
dropped for changing nothing was logged each time (module_replace 8 times in one search of the
README example, issue 36); inside a search (engine.search runs in plan.each_drop_once) it is
logged once."""

import logging

import pytest

pytest.importorskip("transformers")

DROP = "module_replace: dropped because it would change nothing"


def test_each_drop_once_logs_a_repeated_drop_once(caplog, monkeypatch):
    from atorch.auto.plan import each_drop_once, resolve_strategy
    from atorch.auto.strategy import Strategy
    from tests.helpers.hf import tiny_llama

    monkeypatch.setattr(logging.getLogger("atorch"), "propagate", True)  # to caplog's handler

    model = tiny_llama()  # sdpa already: module_replace would change nothing
    with caplog.at_level(logging.INFO, logger="atorch"):
        with each_drop_once():
            for _ in range(3):
                assert resolve_strategy(model, Strategy(["module_replace"])).opt_names == []
        inside = caplog.text.count(DROP)
        resolve_strategy(model, Strategy(["module_replace"]))  # outside a search: each call says it
    assert inside == 1 and caplog.text.count(DROP) == 2
