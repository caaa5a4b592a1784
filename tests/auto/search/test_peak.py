"""PeakMemory, the dry runs' peak tracker: the live bytes of every storage at the step's worst
moment, the model and optimizer state included; where torch's MemTracker works it agrees, and it
also follows a module that runs twice in a step (as a pipeline schedule runs each stage)."""

import torch

from atorch.auto.search.peak import PeakMemory

MIB = 2**20


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _step(model, optim, x):
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def test_agrees_with_memtracker_on_a_training_step():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _model()
    optim = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    _step(model, optim, x)  # optimizer state exists from here on
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        _step(model, optim, x)
    expected = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    with PeakMemory(model, optim) as peak:
        _step(model, optim, x)
    assert peak.peak == expected
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peak.peak > 3 * params  # parameters, two Adam moments and the gradients at least


def test_counts_what_is_alive_at_the_worst_moment():
    with PeakMemory() as peak:
        big = torch.empty(MIB, dtype=torch.uint8)
        view = big[:10]  # the same storage: counted once
        del big, view
        small = torch.empty(MIB // 2, dtype=torch.uint8)
    assert peak.peak == MIB
    assert peak.current == MIB // 2
    del small


def test_counts_what_exists_before_the_step():
    kept = torch.empty(MIB, dtype=torch.uint8)
    with PeakMemory([kept]) as peak:
        temporary = torch.empty(MIB, dtype=torch.uint8)
        del temporary
    assert peak.peak == 2 * MIB


def test_follows_a_storage_resized_in_place():
    # FSDP frees an unsharded parameter with UntypedStorage.resize_(0) and re-allocates it the same way
    original = torch.UntypedStorage.resize_
    with PeakMemory() as peak:
        t = torch.empty(MIB, dtype=torch.uint8)
        t.untyped_storage().resize_(0)
        other = torch.empty(MIB // 2, dtype=torch.uint8)
        t.untyped_storage().resize_(MIB)
    assert peak.peak == MIB + MIB // 2
    assert torch.UntypedStorage.resize_ is original  # restored on exit
    del t, other


def test_follows_a_module_run_twice_in_one_step():
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def twice():  # two microbatches through the same stage, as a pipeline schedule runs them
        for half in torch.randn(32, 64).chunk(2):
            model(half).square().mean().backward()
        optim.step()
        optim.zero_grad()

    with PeakMemory(model, optim) as peak:
        twice()
    assert peak.peak > 2 * sum(p.numel() * 4 for p in model.parameters())


def test_a_tensor_first_seen_in_place_was_alive_all_along():
    # DDP's gradient buckets: allocated when it wraps the model, first touched by backward's copies
    untracked = torch.zeros(MIB, dtype=torch.uint8)
    with PeakMemory() as peak:
        temporary = torch.empty(MIB, dtype=torch.uint8)
        del temporary
        untracked.add_(1)
    assert peak.peak == 2 * MIB  # the buffer was there while the temporary was
    assert peak.current == MIB


class _Slices(torch.utils.data.Dataset):
    """Samples that are views of one 16 MiB tensor, as a dataset that slices its tokens hands out."""

    def __init__(self):
        self.data = torch.randn(2**16, 64)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def test_a_dry_run_does_not_count_the_dataset_its_batch_views():
    # The batch used to be drawn inside the tracked step: indexing the dataset returned a view of
    # its whole storage, counted as the step's memory (8 MiB on search_quality's deep-narrow).
    from atorch.auto.search import measure

    report = measure(_model(), [[]], torch.optim.SGD, _Slices(), lambda batch, out: out.square().mean(),
                     dataloader_args={"batch_size": 8}, timed_steps=1)
    (candidate,) = report.candidates
    assert candidate.measured_peak_bytes is not None
    assert candidate.measured_peak_bytes < MIB  # the model and a batch of 8: about 0.3 MiB


class _EveryOtherStep(torch.nn.Module):
    """Keeps a 2 MiB tensor for its backward on every other forward, as a step whose collective
    buffer the backend's thread frees late keeps one more buffer than the step before."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        if self.calls % 2:
            out = out * torch.ones(2 * MIB // 4, requires_grad=True)[: out.shape[-1]].expand_as(out)
        return out


def test_a_dry_run_counts_the_highest_peak_of_the_steps_it_tracks():
    # One tracked step saw the big step or the small one by the parity of the steps before it.
    from atorch.auto.search import dryrun, measure

    assert dryrun.PEAK_STEPS >= 2
    for timed_steps in (1, 2):
        report = measure(_EveryOtherStep(), [[]], torch.optim.SGD, torch.randn(16, 64),
                         lambda batch, out: out.square().mean(), dataloader_args={"batch_size": 8},
                         timed_steps=timed_steps)
        (candidate,) = report.candidates
        assert candidate.measured_peak_bytes > 2 * MIB, timed_steps
