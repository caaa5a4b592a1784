"""Dry runs leave nothing behind (issue 18): after the search has estimated and dry-run several
candidates in this process, the tensor memory alive is back at its baseline, not one model copy
(parameters, gradients, optimizer state) higher per candidate."""

import gc

import torch

from tests.helpers.dist import run_distributed

CANDIDATES = [["parallel_mode"], ["parallel_mode", "zero2"], ["parallel_mode", "fsdp"],
              ["parallel_mode", "zero1"], ["parallel_mode", "checkpoint"], ["parallel_mode", ("amp_native", "bf16")]]


def _live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                key = storage.data_ptr()
            except RuntimeError:  # a tensor subclass without a storage of its own (a DTensor)
                continue
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _measure_twice():
    from atorch.auto.search import measure
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    model = TinyTransformer()
    job = {"optim_args": {"lr": 1e-2}, "dataloader_args": {"batch_size": 8}, "model_input_format": "unpack_dict",
           "timed_steps": 1, "warmup_steps": 1}
    measure(model, CANDIDATES[:1], torch.optim.AdamW, TokenDataset(), lm_loss, **job)  # first-use caches
    baseline = _live_tensor_bytes()
    report = measure(model, CANDIDATES, torch.optim.AdamW, TokenDataset(), lm_loss, **job)
    after = _live_tensor_bytes()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return baseline, after, model_bytes, [c.status for c in report.candidates]


def test_memory_after_dry_runs_returns_to_the_baseline():
    for baseline, after, model_bytes, statuses in run_distributed(_measure_twice, 2, timeout_s=300):
        assert statuses == ["measured"] * len(CANDIDATES)
        # Each leaked copy would hold at least its parameters, gradients and AdamW state (4x).
        assert after - baseline < model_bytes / 4, (baseline, after, model_bytes)


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_search_freezes_what_existed_and_still_collects_its_own_garbage():
    from atorch.auto.search.dryrun import collector_frozen

    assert gc.get_freeze_count() == 0
    with collector_frozen():
        assert gc.get_freeze_count() > 0  # the imports and the caller's objects: skipped
        _Cycle()
        assert gc.collect() >= 1  # a cycle made during the search is still found
    assert gc.get_freeze_count() == 0
    # a process that froze objects itself keeps them frozen
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
