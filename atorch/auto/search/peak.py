"""Peak tensor memory of a step on one rank, on any device: the live bytes of every storage the
step allocates, plus those of the model, gradients and optimizer state it starts with.

torch's MemTracker measures the same quantity but also keeps per-module statistics, and raises
when a module runs twice in one step, which a pipeline schedule does once per microbatch (the
error on one stage left the other stages waiting in their point-to-point transfers). This tracker
keeps no module statistics, so it follows every strategy, pipelines included.

A storage is counted from the first operator that returns a tensor on it until Python's last
reference to it goes (a weak reference's callback): PyTorch keeps one Python object per storage
for as long as the storage lives. Resizes (FSDP frees and re-allocates unsharded parameters with
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
                tensors = [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            else:
                tensors = [v for v in tree_leaves(obj) if isinstance(v, torch.Tensor)]
            for tensor in tensors:
                self._count(tensor)

    def _count(self, tensor: torch.Tensor) -> None:
        for storage in _storages(tensor):
            key = storage._cdata
            size = storage.nbytes()
            with self._lock:
                if key in self._sizes:
                    self._resized(key, size)
                    continue
                self._sizes[key] = size
                self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._gone(key))
                self._add(size)

    def _resized(self, key: int, size: int) -> None:
        with self._lock:
            self._add(size - self._sizes[key])
            self._sizes[key] = size

    def _gone(self, key: int) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            self._refs.pop(key, None)
            if size is not None:
                self.current -= size

    def _add(self, size: int) -> None:
        self.current += size
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        try:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._count(leaf)
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
            result = original(storage, size)
            if storage._cdata in tracker._sizes:
                tracker._resized(storage._cdata, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        return entered

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        # The callbacks would keep counting after the step: drop them with their references.
        self._refs.clear()
        return super().__exit__(*exc)
