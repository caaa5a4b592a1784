"""GenomicBottleneck: g-nets that generate a model's large weight matrices, spread over ranks.

The training loop (torchGB's, unchanged)::

    gnets = GenomicBottleneck(model, tile_size=64, gnet_width=32, gnet_depth=2)
    optimizer = torch.optim.Adam(gnets.direct_parameters(), lr=1e-3)   # the p-net's own params
    for batch in data:
        gnets.zero_grad()          # g-net grads and the covered weights' grads
        gnets.predict_weights()    # owners run their g-nets; every rank receives every weight
        loss = loss_fn(model(batch))
        loss.backward()            # grads of the covered weights land on the p-net as usual
        gnets.backward()           # those grads, averaged to each owner, flow into its g-nets
        optimizer.step()           # the directly trained params
        gnets.step()               # the g-nets' own optimizers
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from atorch.compression.distributed import OwnerComm, assign_owners
from atorch.compression.encoding import assemble, num_tiles, tile_shape_for
from atorch.compression.gnet import GNet, build_gnet
from atorch.compression.layers import gnet_type_for
from atorch.errors import CompressionError


@dataclass
class GNetRecord:
    """One covered parameter and the g-net that predicts it (``gnet`` is ``None`` off its owner)."""

    name: str
    rank: int
    shapes: list[tuple[int, int]]
    tile: tuple[int, int]
    n_tiles: int
    numel: int
    gnet_numel: int
    module: nn.Module = field(repr=False)
    param_name: str = field(repr=False)
    build_fn: Any = field(repr=False)
    gnet: GNet | None = field(default=None, repr=False)
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= 1 for v in pair):
        raise CompressionError(f"tile_size must be a positive int or (rows, cols), got {value!r}")
    return pair


class GenomicBottleneck:
    """Covers ``model``'s large ``nn.Linear``, ``nn.Conv2d`` and attention projection weights with
    g-nets (see :mod:`atorch.compression.layers` for more types) and trains those instead.

    - ``tile_size``: tile of a weight matrix a g-net sees (int or ``(rows, cols)``); a g-net has
      one output per tile, so larger tiles compress more.
    - ``gnet_width``, ``gnet_depth``: hidden units per layer and hidden layers of each g-net.
    - ``min_numel``: weights with fewer elements are trained directly; ``ignore_layers``: module
      or parameter names (fnmatch patterns allowed) trained directly as well.
    - ``optimizer_cls``/``optimizer_args``: each g-net's own optimizer (default Adam, lr 1e-3).
    - ``process_group``: ranks that share the g-nets (each trains its share); ``None``: the
      default group when torch.distributed is initialized, else this process only; ``"local"``:
      this process only.
    - ``reduce_grads``: whether :meth:`backward` averages the covered weights' grads over the
      ranks onto each owner. ``None`` (default): yes, unless ``model`` is already a DDP wrapper
      (whose allreduce has averaged them). A DDP wrapper made *after* this object skips the
      covered weights (they are marked as ignored), so the averaging happens here, to the owner
      only.
    - ``seed``: g-net initialization; each g-net's seed comes from its parameter name, so the
      g-nets start the same on every rank and at every world size.
    """

    def __init__(self, model: nn.Module, tile_size: int | tuple[int, int] = 64, gnet_width: int = 32,
                 gnet_depth: int = 2, min_numel: int = 4096, ignore_layers: list[str] | tuple[str, ...] = (),
                 optimizer_cls: type = torch.optim.Adam, optimizer_args: dict | None = None,
                 process_group: Any = None, reduce_grads: bool | None = None, seed: int = 0,
                 bucket_mb: float = 25.0):
        if gnet_width < 1 or gnet_depth < 1:
            raise CompressionError(f"gnet_width and gnet_depth must be >= 1, got {gnet_width} and {gnet_depth}")
        self.tile_size = _pair(tile_size)
        self.gnet_width, self.gnet_depth, self.seed = gnet_width, gnet_depth, seed
        self.min_numel, self.ignore_layers = min_numel, list(ignore_layers)
        self.optimizer_cls, self.optimizer_args = optimizer_cls, dict(optimizer_args or {"lr": 1e-3})
        is_ddp = isinstance(model, DistributedDataParallel)
        self.model = model.module if is_ddp else model
        self.reduce_grads = (not is_ddp) if reduce_grads is None else reduce_grads
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        group = None if process_group in (None, "local") else process_group
        bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        self.comm = OwnerComm(group, bucket_numel)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size

        self.gnetdict: dict[str, GNetRecord] = self._analyse()
        owners = assign_owners({n: r.numel for n, r in self.gnetdict.items()}, self.world_size)
        for name, record in self.gnetdict.items():
            record.rank = owners[name]
            self._build(record)
        self._params = {name: self.model.get_parameter(name) for name in self.gnetdict}
        self._covered_ids = {id(p) for p in self._params.values()}
        if not is_ddp:
            ignored = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ())) | set(self.gnetdict)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, sorted(ignored))
        self._graphs: dict[str, torch.Tensor] = {}
        self.predicted_with_grad = False
        self.stale = True
        with torch.no_grad():
            self.predict_weights()

    # ----- analysis -----------------------------------------------------------------------
    def _ignored(self, module_name: str, param_name: str) -> bool:
        full = f"{module_name}.{param_name}" if module_name else param_name
        return any(fnmatch.fnmatchcase(full, p) or fnmatch.fnmatchcase(module_name, p)
                   or module_name.startswith(p + ".") for p in self.ignore_layers)

    def _analyse(self) -> dict[str, GNetRecord]:
        records, seen = {}, set()
        names = [n for n, _ in self.model.named_modules()] + [n for n, _ in self.model.named_parameters()]
        unmatched = [p for p in self.ignore_layers if not any(fnmatch.fnmatchcase(n, p) or n.startswith(p + ".") for n in names)]
        if unmatched:
            raise CompressionError(
                f"ignore_layers entries {unmatched} match no module or parameter of the model; names look like "
                f"{[n for n, _ in self.model.named_parameters()][:5]}"
            )
        for module_name, module in self.model.named_modules():
            entry = gnet_type_for(module)
            if entry is None:
                continue
            for param_name, shapes in entry.init_fn(module).items():
                param = module.get_parameter(param_name)
                full = f"{module_name}.{param_name}" if module_name else param_name
                if (id(param) in seen or not param.requires_grad or param.numel() < self.min_numel
                        or self._ignored(module_name, param_name)):
                    continue
                seen.add(id(param))
                shapes = [tuple(int(d) for d in s) for s in shapes]
                if sum(r * c for r, c in shapes) != param.numel():
                    raise CompressionError(
                        f"the g-net type of {type(module).__qualname__} describes {full} as matrices {shapes}, which "
                        f"do not hold its {param.numel()} elements; fix its init_fn"
                    )
                tile = tile_shape_for(shapes, self.tile_size)
                records[full] = GNetRecord(
                    name=full, rank=0, shapes=shapes, tile=tile, n_tiles=sum(num_tiles(s, tile) for s in shapes),
                    numel=param.numel(), gnet_numel=0, module=module, param_name=param_name, build_fn=entry.build_fn,
                )
        if not records:
            raise CompressionError(
                f"no weight of the model is covered by a g-net: lower min_numel (now {self.min_numel}), shorten "
                "ignore_layers, or register the model's layer types with register_gnet_type"
            )
        return records

    def _build(self, record: GNetRecord) -> None:
        param = record.module.get_parameter(record.param_name)
        owned = record.rank == self.rank
        device = param.device if owned and not param.is_meta else "meta"
        gnet = build_gnet(record.name, record.tile, record.n_tiles, self.gnet_width, self.gnet_depth, self.seed, device)
        record.gnet_numel = sum(p.numel() for p in gnet.parameters())
        if owned:
            gnet.calibrate(param.detach().float().std().item() if param.numel() > 1 else 1.0)
            record.gnet = gnet
            record.optimizer = self.optimizer_cls(gnet.parameters(), **self.optimizer_args)

    # ----- the training loop ----------------------------------------------------------------
    def _predict(self, record: GNetRecord) -> torch.Tensor:
        tiles = record.gnet()
        matrices, start = [], 0
        for shape in record.shapes:
            count = num_tiles(shape, record.tile)
            matrices.append(assemble(tiles[start:start + count], shape, record.tile))
            start += count
        return record.build_fn(record.module, record.param_name, matrices)

    def owned(self) -> list[GNetRecord]:
        """The records of the g-nets this rank trains."""
        return [r for r in self.gnetdict.values() if r.rank == self.rank]

    def predict_weights(self) -> None:
        """Write every covered weight of the p-net from its g-net (collective over the ranks).

        With grad enabled, each owner keeps the graph from its g-nets to the predictions for
        :meth:`backward`.
        """
        self._graphs = {r.name: self._predict(r) for r in self.owned()}
        self.comm.broadcast_from_owners(self._graphs, self._params, {n: r.rank for n, r in self.gnetdict.items()})
        self.predicted_with_grad = torch.is_grad_enabled()
        if not self.predicted_with_grad:
            self._graphs = {}
        self.stale = False

    def refresh(self) -> None:
        """:meth:`predict_weights` only when needed: the g-nets changed since the last prediction,
        or a forward with grad needs a graph that :meth:`backward` has consumed (collective)."""
        if self.stale or (torch.is_grad_enabled() and not self.predicted_with_grad):
            self.predict_weights()

    def backward(self) -> None:
        """Push the covered weights' grads into the g-nets (collective), then clear those grads so
        that no p-net optimizer updates the covered weights as well."""
        if not self.predicted_with_grad:
            raise CompressionError("GenomicBottleneck.backward() needs predict_weights() (with grad enabled) before the forward")
        grads = {name: p.grad for name, p in self._params.items()}
        owners = {n: r.rank for n, r in self.gnetdict.items()}
        if self.reduce_grads:
            mine = self.comm.mean_to_owners(grads, owners, self._params)
        else:
            mine = {r.name: grads[r.name] for r in self.owned() if grads[r.name] is not None}
        outputs = [self._graphs[name] for name in mine]
        if outputs:
            torch.autograd.backward(outputs, [mine[n].to(self._graphs[n].dtype) for n in mine])
        for param in self._params.values():
            param.grad = None
        self._graphs = {}
        self.predicted_with_grad = False

    def step(self) -> None:
        """Step each owned g-net's optimizer; the p-net's weights are stale until the next prediction."""
        for record in self.owned():
            record.optimizer.step()
        self.stale = True

    def zero_grad(self) -> None:
        """Clear the g-nets' grads and the covered weights' grads."""
        for record in self.owned():
            record.optimizer.zero_grad(set_to_none=True)
        for param in self._params.values():
            param.grad = None

    # ----- parameters and reporting ---------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The parameters of the g-nets this rank trains."""
        return [p for r in self.owned() for p in r.gnet.parameters()]

    def direct_parameters(self) -> list[nn.Parameter]:
        """The p-net's trainable parameters that no g-net covers: what the user's optimizer needs."""
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in self._covered_ids]

    def is_covered(self, param: torch.Tensor) -> bool:
        """Whether a g-net produces ``param``."""
        return id(param) in self._covered_ids

    def covered_numel(self) -> int:
        """Elements of the p-net predicted by g-nets."""
        return sum(r.numel for r in self.gnetdict.values())

    def gnet_numel(self) -> int:
        """Parameters of all g-nets (on all ranks)."""
        return sum(r.gnet_numel for r in self.gnetdict.values())

    def compression_ratio(self) -> float:
        """Covered p-net parameters over g-net parameters (biases, small and ignored layers, which
        are trained directly, count in neither)."""
        return self.covered_numel() / self.gnet_numel()

    def __repr__(self) -> str:
        lines = [f"GenomicBottleneck(tile_size={self.tile_size}, gnet_width={self.gnet_width}, "
                 f"gnet_depth={self.gnet_depth}, ranks={self.world_size})"]
        width = max(len(n) for n in self.gnetdict)
        lines.append(f"  {'covered weight':<{width}}  {'shape':>14}  {'tiles':>5}  {'g-net params':>12}  rank")
        for record in self.gnetdict.values():
            shape = "x".join(str(d) for d in self._params[record.name].shape)
            lines.append(f"  {record.name:<{width}}  {shape:>14}  {record.n_tiles:>5}  {record.gnet_numel:>12,}  {record.rank:>4}")
        direct = sum(p.numel() for p in self.direct_parameters())
        lines.append(f"  {self.covered_numel():,} weights from {self.gnet_numel():,} g-net parameters: compression "
                     f"{self.compression_ratio():.1f}x; {direct:,} p-net parameters trained directly")
        return "\n".join(lines)

    # ----- checkpoints ------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Save every g-net (and its optimizer) under directory ``path``, one file per owner rank
        (collective). See :func:`atorch.compression.io.save_gnets`."""
        from atorch.compression.io import save_gnets

        save_gnets(self, path)

    def load(self, path: str) -> None:
        """Load g-nets saved by :meth:`save`, at any world size, and re-predict the p-net's
        weights (collective). See :func:`atorch.compression.io.load_gnets`."""
        from atorch.compression.io import load_gnets

        load_gnets(self, path)
        self.stale = True
        with torch.no_grad():
            self.predict_weights()
