"""What a resumed run needs besides weights: random streams, and plain-data objects.

Objects (the lr scheduler's and dataloader's state, the user's ``extra``, RNG states) are stored
as opaque byte blobs written by ``torch.save`` and read back with ``weights_only=True``: only
tensors, numbers, strings, lists, tuples and dicts come back, so loading a checkpoint someone
shared cannot run code hidden in it.
"""

import io
import pickle
import random

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from atorch.errors import CheckpointError


def pack(obj, what: str) -> bytes:
    """``obj`` as bytes that :func:`unpack` can read; :class:`CheckpointError` if it is not plain data."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{what} holds objects other than tensors, numbers, strings, lists, tuples and dicts, which a "
            f"checkpoint does not store (loading them would run code): {str(error).splitlines()[0]}"
        ) from None
    return data


def unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor entries are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def rng_state(model: torch.nn.Module | None = None) -> dict:
    """This process's random streams: python, numpy, torch (CPU and CUDA), and the tensor-parallel
    tracker ``model`` draws from (its own, or the process-wide one)."""
    from atorch.parallel_layers.random import tracker_of

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": dict(tracker_of(model).states)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:
        pass
    return state


def set_rng_state(state: dict, model: torch.nn.Module | None = None) -> None:
    """Restore what :func:`rng_state` returned (the tracker into the one ``model`` draws from).

    The tracker's streams are restored where the checkpoint has them and kept where it has none:
    a job saved under a strategy without tensor-parallel streams (ddp) loads into one that seeded
    them when it was applied (tensor_parallel), and its forward finds them."""
    from atorch.parallel_layers.random import tracker_of

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    tracker = tracker_of(model)
    tracker.states = {**tracker.states, **state["tracker"]}
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
