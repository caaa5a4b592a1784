"""The search's pipeline layouts are judged on the job's own batch (its first, cut to a
microbatch): a model that cannot be split with it is ineligible without a dry run, and one that
can is kept. Before, the model was traced with ``input_ids`` only, so a forward that branches on
its attention mask passed and failed in every dry run."""

import pytest
import torch
from torch import nn

from atorch.auto.environment import DeviceContext

DEVICE = DeviceContext(2, 2, torch.device("cpu"), None, 2**30)


class MaskBranches(nn.Module):
    """Splits at its blocks, but its forward branches on the mask's values: torch.export refuses it
    when the mask is traced, not when only input_ids are."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        # 8 blocks: every pipeline layout of 2 ranks splits them, 4 virtual stages a rank included
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(8))
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None and bool((attention_mask == 0).any()):
            h = h * attention_mask.unsqueeze(-1)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(rows: int = 8, **extra) -> dict:
    mask = torch.ones(rows, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return {"input_ids": torch.randint(1, 16, (rows, 6)), "attention_mask": mask, **extra}


def _pipeline_reasons(model, batch, global_batch: int = 8) -> dict:
    """The pipeline layouts' reasons (None: eligible), by layout text."""
    from atorch.auto.search.space import layout_space
    from atorch.utils.memo import kept

    first_batch = None if batch is None else (lambda data: batch)
    with kept():
        eligible, ineligible = layout_space(model, DEVICE, global_batch, "unpack_dict",
                                            excluded=["tensor_parallel", "mixed_parallel", "ds_3d_parallel"],
                                            first_batch=first_batch)
    reasons = {layout.text: None for layout in eligible if layout.method}
    reasons.update({layout.text: why for layout, why in ineligible})
    return reasons


def test_a_forward_that_branches_on_the_batchs_mask_is_ineligible_and_says_where():
    without = _pipeline_reasons(MaskBranches(), None)
    assert without and all(why is None for why in without.values()), without  # structure only: kept
    reasons = _pipeline_reasons(MaskBranches(), _batch())
    assert reasons.keys() == without.keys()
    for layout, why in reasons.items():
        assert why is not None and "Python control flow on a tensor's value" in why, (layout, why)
        assert "test_pipeline_eligible_batch.py" in why, why  # the line that branches


def test_a_batch_the_model_takes_keeps_its_pipelines_and_other_batches_say_why_not():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=8,
                                                    num_attention_heads=2, intermediate_size=16, num_labels=3))
    reasons = _pipeline_reasons(bert, _batch(labels=torch.randint(0, 3, (8,))))
    assert reasons and all(why is None for why in reasons.values()), reasons  # mask and labels traced
    pairs = _pipeline_reasons(MaskBranches(), (torch.zeros(8, 6, dtype=torch.long), torch.zeros(8)))
    assert all("this job's batches are tuples" in why for why in pairs.values()), pairs


class _MaskedTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        mask = torch.ones(6, dtype=torch.long)
        mask[4 + i % 2:] = 0
        return {"input_ids": torch.arange(6) % 15 + 1, "attention_mask": mask}


def _token_loss(batch, output):
    return nn.functional.cross_entropy(output.flatten(0, 1), batch["input_ids"].flatten())


def _search(report_file: str):
    from atorch.auto import auto_accelerate
    from tests.auto.search.one_method import OTHERS

    torch.manual_seed(0)
    status, _, strategy = auto_accelerate(
        MaskBranches(), torch.optim.SGD, _MaskedTokens(), _token_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=report_file,
        excluded=[m for m in OTHERS if m != "pipeline_parallel"] + ["mixed_parallel", "ds_3d_parallel"],
        dryrun_warmup_steps=1, dryrun_steps=1, use_search_cache=False)
    return status, None if strategy is None else strategy.opt_names


def test_the_search_rules_such_pipelines_out_without_a_dry_run(tmp_path):
    from atorch.auto.search.candidate import INELIGIBLE
    from atorch.auto.search.report import SearchReport
    from tests.helpers.dist import run_distributed

    path = str(tmp_path / "report.json")
    assert run_distributed(_search, 2, path, timeout_s=150) == [(True, ["parallel_mode"])] * 2
    pipelines = [c for c in SearchReport.load(path).candidates if "pipeline_parallel" in c.names]
    # ineligible: never dry-run (a dry run would have failed on the same trace, after seconds of it)
    assert pipelines and all(c.pruned_by == INELIGIBLE and not c.seconds for c in pipelines), pipelines
    assert all("Python control flow on a tensor's value" in c.reason for c in pipelines), pipelines


def test_the_layout_space_traces_the_model_once_per_stage_count(monkeypatch):
    """The search asks every pipeline layout's eligibility with one batch: layouts with as many stages
    (microbatch counts, data-parallel sizes) share one trace, with or without a plan's outer
    ``kept()`` (a search has none: 12 traces of gpt2-tied's on 4 ranks took 24 of its 59 s)."""
    from atorch.auto.search.space import layout_space
    from atorch.methods import pipeline_parallel

    traced = []
    real = pipeline_parallel.pipeline_eligibility

    def counted(model, stages, *args, **kwargs):
        traced.append(stages)
        return real(model, stages, *args, **kwargs)

    monkeypatch.setattr(pipeline_parallel, "pipeline_eligibility", counted)
    device = DeviceContext(4, 4, torch.device("cpu"), None, 2**30)
    eligible, ineligible = layout_space(MaskBranches(), device, 8, "unpack_dict", first_batch=lambda data: _batch(),
                                        excluded=["tensor_parallel", "mixed_parallel", "ds_3d_parallel"])
    pipelines = [layout for layout in eligible if layout.method] + [layout for layout, _ in ineligible]
    assert len(pipelines) > len(set(traced)), (pipelines, traced)  # several layouts per stage count
    assert sorted(traced) == sorted(set(traced)), traced  # each stage count traced once
