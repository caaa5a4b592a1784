"""``max_dryruns`` counts dry runs, not places: a candidate the dry runs so far prune (cannot fit,
cannot win, a twin measured to fit) gives its slot to the next candidate in estimated order (on
search_quality's boundary scenario, 8 slots went to candidates that all measured over the budget
and the one that fits never ran). Here a rule prunes the second candidate in order, whatever it
is, so the slot logic is checked alone, on real dry runs of one process."""

import torch

from atorch.auto.search import candidate, stop
from atorch.auto.search.report import MEASURED, SearchReport

MAX_DRYRUNS = 2


def _search(tmp_path, monkeypatch, max_dryruns: int) -> SearchReport:
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    checked = []

    def second_cannot_win(result, so_far, global_batch):
        checked.append(result)
        return "cannot win: pruned by the test" if len(checked) == 2 else None

    monkeypatch.setattr(stop, "check", second_cannot_win)
    path = tmp_path / "report.json"
    torch.manual_seed(0)
    status, _, _ = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=str(path),
        max_dryruns=max_dryruns, dryrun_warmup_steps=1, dryrun_steps=2, use_search_cache=False,
        excluded=["fused_optimizer", "native_dynamo"])  # a trial on the pick is dry-run beyond max_dryruns
    assert status
    return SearchReport.load(str(path))


def test_a_pruned_candidate_gives_its_slot_to_the_next(tmp_path, monkeypatch):
    report = _search(tmp_path, monkeypatch, MAX_DRYRUNS)
    pruned = [c for c in report.candidates if c.pruned_by == stop.CANNOT_WIN]
    measured = [c for c in report.candidates if c.status == MEASURED]
    assert len(pruned) == 1 and pruned[0].reason == "cannot win: pruned by the test"
    # the slot went on: as many dry runs as max_dryruns, the next candidate in order among them
    assert report.dry_run == MAX_DRYRUNS == len(measured)
    assert sum(c.pruned_by == candidate.MAX_DRYRUNS for c in report.candidates) >= 1
