"""Random streams for dropout in and out of tensor-parallel regions (Megatron's RNG tracker).

Outside a tensor-parallel region every rank of a tensor group holds the same activations, so
their dropout masks must be equal: the default generator carries the same seed on those ranks.
Inside a region each rank holds different heads or features, and their masks should be
independent: code there runs under ``tracker.fork()``, which swaps in a stream seeded per
tensor-parallel rank and swaps the default back afterwards, untouched.
"""

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_OFFSET = 2718  # keeps the per-rank streams away from the default seed


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _device_type() == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named random states that code can step into with :meth:`fork`."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; reset() the tracker first")
        saved = _get_state()
        torch.manual_seed(seed) if _device_type() == "cpu" else torch.cuda.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def kept(self):
        """Run the block and put every stream back as it was (what ``torch.random.fork_rng`` does
        for the default stream): a pass that only infers shapes must not move them."""
        saved = {name: state.clone() for name, state in self.states.items()}
        try:
            yield
        finally:
            self.states = saved

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream ``name``; the default stream is as it was afterwards."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not set; call model_parallel_manual_seed(seed) first")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()


TRACKER_ATTR = "_atorch_rng_tracker"


def get_rng_state_tracker() -> RNGStatesTracker:
    """The process-wide tracker (NxD's API): layers built by hand fork from it."""
    return _TRACKER


def attach_tracker(model: torch.nn.Module, tracker: RNGStatesTracker) -> None:
    """Make ``tracker`` the one :func:`tracker_of` returns for ``model`` (and what wraps it)."""
    setattr(model, TRACKER_ATTR, tracker)


def tracker_of(model: torch.nn.Module | None) -> RNGStatesTracker:
    """The tracker ``model``'s tensor-parallel regions draw from: its own when the tensor_parallel
    method sharded it (looked up through wrappers such as DDP), else the process-wide one."""
    if model is not None:
        for module in model.modules():
            tracker = module.__dict__.get(TRACKER_ATTR)
            if tracker is not None:
                return tracker
    return _TRACKER


def model_parallel_manual_seed(seed: int, tensor_parallel_rank: int | None = None) -> None:
    """Seed the default stream with ``seed`` (equal on a tensor group's ranks) and the
    model-parallel stream with ``seed + 2718 + tensor_parallel_rank`` (different on each).
    ``tensor_parallel_rank=None`` reads it from :mod:`atorch.parallel_state`."""
    if tensor_parallel_rank is None:
        from atorch import parallel_state

        tensor_parallel_rank = (parallel_state.get_tensor_model_parallel_rank()
                                if parallel_state.model_parallel_is_initialized() else 0)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _OFFSET + tensor_parallel_rank)


class ForkedForward:
    """A module forward that runs on a tracker stream (attention dropout on split heads)."""

    def __init__(self, forward, tracker: RNGStatesTracker, name: str = MODEL_PARALLEL_RNG):
        self.forward, self.tracker, self.name = forward, tracker, name

    def __call__(self, *args, **kwargs):
        with self.tracker.fork(self.name):
            return self.forward(*args, **kwargs)
