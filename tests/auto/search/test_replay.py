"""The search decides as it did when its replays were recorded (tests/auto/search/replay.py): the
same candidates, estimates to the last digit, prunes and their reasons, dry runs, ties and pick,
on the recorded machine, for benchmarks/search_quality.py's nine scenarios, the README example
and the shapes of this folder's searches."""

import json

import pytest

from tests.auto.search.replay import SCENARIOS, differences, replay, stored


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_search_decides_as_recorded(name, tmp_path):
    actual = json.loads(json.dumps(replay(name, tmp_path)))
    diff = differences(stored(name), actual)
    assert not diff, (f"{name}: the search decides differently from its replay (re-record with "
                      f"`python -m tests.auto.search.replay --record {name}` only for a change meant to "
                      "change decisions):\n  " + "\n  ".join(diff))


def test_a_changed_decision_shows():
    """The comparison itself sees a changed reason and a changed estimate (a replay that cannot fail
    would prove nothing)."""
    recorded = stored("small")
    changed = json.loads(json.dumps(recorded))
    changed["report"]["candidates"][-1]["reason"] = "another reason"
    first = next(c for c in changed["report"]["candidates"] if c["estimated_step_seconds"])
    first["estimated_step_seconds"] *= 1 + 1e-15
    assert len(differences(recorded, changed)) == 2


def test_the_model_goes_from_stage_to_stage(tmp_path):
    """The model handed to auto_accelerate, followed through the search of the README example
    (tests/helpers/model_path.py: each function that receives it, once), comes back to a file it
    had left at most 22 times (13 at the redesign; the stages call the methods' own files, which
    call the shared module helpers; 21 since fsdp and zero2 check a pipeline layout's model in
    sharding/fsdp2.py, 2026-11-28; 22 since mixed_parallel asks the layout registry whether the
    model splits as a decoder, pipeline/layouts.is_decoder_lm, 2026-11-29)."""
    import torch

    from atorch import auto_accelerate
    from atorch.utils.log import quiet
    from tests.auto.search.replay import _job, recorded
    from tests.helpers.model_path import ModelPath

    scenario = SCENARIOS["readme"]
    torch.manual_seed(0)
    model, dataset, loss_func, input_format, batch = _job(scenario)
    with recorded(scenario), quiet(), ModelPath(model) as path:
        auto_accelerate(model, torch.optim.AdamW, dataset, loss_func, optim_args={"lr": 1e-3},
                        dataloader_args={"batch_size": batch}, model_input_format=input_format,
                        use_search_cache=False, search_only=True)
    assert "auto/search/estimate.py" in path.stays()  # the path was followed into the stages
    assert path.returns() <= 22, " -> ".join(path.stays())
