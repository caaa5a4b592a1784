"""Peak tensor memory of a step on one rank, on any device: the live bytes of every storage the
step allocates, plus those of the model, gradients and optimizer state it starts with.

torch's MemTracker measures the same quantity but also keeps per-module statistics, and raises
when a module runs twice in one step, which a pipeline schedule does once per microbatch (the
error on one stage left the other stages waiting in their point-to-point transfers). This tracker
keeps no module statistics, so it follows every strategy, pipelines included.

A storage is counted from the first operator that returns a tensor on it until Python's last
reference to it goes (a weak reference's callback): PyTorch keeps one Python object per storage
for as long as the storage lives. A storage first seen as the result of an operator that writes
into its input (an in-place operator on a tensor the tracker was not given) existed before the
step and is counted from its start: DDP's gradient buckets. A view of such a tensor is counted
from the view on (FSDP2 allocates some storages out of dispatch's sight). Resizes (FSDP frees and re-allocates unsharded parameters with
``UntypedStorage.resize_``, which no dispatch mode sees) are followed by wrapping ``resize_`` while
the tracker is active. Wrapper subclasses (DTensor) count their inner tensors. Temporaries an
operator allocates and frees inside itself are not seen.
"""

import threading
import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storages(tensor: torch.Tensor) -> Iterable[torch.UntypedStorage]:
    pending = [tensor]
    while pending:
        t = pending.pop()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            pending.extend(inner for inner in (getattr(t, n) for n in names) if isinstance(inner, torch.Tensor))
        elif t.device.type != "meta" and t.layout == torch.strided:  # sparse tensors have no single storage
            yield t.untyped_storage()


def optimizer_state(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state, and of the optimizers it wraps (``.optim``: PyTorch's
    ZeroRedundancyOptimizer keeps its shard's state in the optimizer it wraps, not in its own)."""
    tensors, seen = [], set()
    while isinstance(optim, torch.optim.Optimizer) and id(optim) not in seen:
        seen.add(id(optim))
        tensors += [v for state in optim.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        optim = getattr(optim, "optim", None)
    return tensors


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory(model, optimizer) as tracker: step()``; then ``tracker.peak`` (bytes),
    which is not to be trusted when ``tracker.failed`` (a tensor it could not read)."""

    def __init__(self, *external):
        super().__init__()
        self.current = self.peak = 0
        self._sizes: dict[int, int] = {}  # storage (its C++ address) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._external = external
        # A storage may be freed on another thread (a collective's); re-entrant: a callback can
        # run inside _count, when a new entry makes Python collect garbage.
        self._lock = threading.RLock()

    def track(self, *objects) -> None:
        """Count the tensors of modules (parameters, gradients, buffers), optimizers (state) and
        tensors that exist before the step."""
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
                tensors += [p.grad for p in obj.parameters() if p.grad is not None]
            elif isinstance(obj, torch.optim.Optimizer):
                tensors = optimizer_state(obj)
            else:
                tensors = [v for v in tree_leaves(obj) if isinstance(v, torch.Tensor)]
            for tensor in tensors:
                self._count(tensor)

    def _count(self, tensor: torch.Tensor, inputs: frozenset = frozenset()) -> None:
        """Count ``tensor``'s storages; one not seen before that is among ``inputs`` (the
        storages an in-place operator wrote into) existed before the step."""
        for storage in _storages(tensor):
            self._count_storage(storage, storage._cdata in inputs)

    def _count_storage(self, storage: torch.UntypedStorage, existing: bool) -> None:
        key = storage._cdata
        size = storage.nbytes()
        with self._lock:
            if key in self._sizes:
                self._resized(key, size)
                return
            self._sizes[key] = size
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._gone(key))
            if existing:
                self._existing(key, size)
            else:
                self._changed(key, size, new=True)

    def _existing(self, key: int, size: int) -> None:
        """Storage ``key`` was alive before the step (seen first as an operator's input, like
        DDP's gradient buckets, which it allocates when it wraps the model): alive all along."""
        self.current += size
        self.peak += size

    def _resized(self, key: int, size: int) -> None:
        with self._lock:
            self._changed(key, size - self._sizes[key])
            self._sizes[key] = size

    def _gone(self, key: int) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            self._refs.pop(key, None)
            if size is not None:
                self._changed(key, -size)

    def _changed(self, key: int, size: int, new: bool = False) -> None:
        """Storage ``key`` grew by ``size`` bytes (shrank when negative; ``new``: it appeared)."""
        self.current += size
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        try:
            # An operator that writes into its input (DDP's bucket copies, a collective's output
            # buffer) shows a storage that existed before it: a view may show one the tracker
            # missed while it was allocated (FSDP2 allocates some storages out of dispatch's sight).
            inputs = None
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    if inputs is None:
                        inputs = frozenset(s._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                                           for s in _storages(t)) if func._schema.is_mutable else frozenset()
                    self._count(leaf, inputs)
        except Exception:  # noqa: BLE001 - the step goes on (a pipeline's peers wait for it); the peak is void
            self.failed = True
        return out

    def __enter__(self):
        self.failed = False
        self.track(*self._external)
        entered = super().__enter__()
        original = self._original_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            # FSDP's unsharded parameters exist before the step, resized to nothing: known from
            # here at the size they had, so that growing them counts from now on
            tracker._count_storage(storage, existing=True)
            result = original(storage, size)
            tracker._resized(storage._cdata, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        return entered

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        # The callbacks would keep counting after the step: drop them with their references.
        self._refs.clear()
        return super().__exit__(*exc)
