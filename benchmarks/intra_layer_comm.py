"""Communication per training step of the 3D tensor-parallel Linear (atorch.intra_layer) against
1D (Megatron) tensor parallelism, for the same layer sizes on the same number of ranks.

    python benchmarks/intra_layer_comm.py --nproc 4 --out benchmarks/results/intra_layer_comm

Spawns gloo processes on the CPU and runs one forward + backward (+ gradient sync) step of each
configuration with torch.distributed's collectives wrapped by a counter, so the bytes are the
ones really sent through the process groups. Each count is checked against the closed-form
formula (docs/intra_layer.md). Two quantities per rank: payload (the tensors handed to the
collectives) and an estimate of the bytes each rank sends with ring algorithms
(all-reduce 2(p-1)/p of the tensor, all-gather and reduce-scatter (p-1)/p of the whole).
Writes JSON and a markdown table.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (hidden, ffn, global tokens per step): activations dominate, then weights dominate
SIZES = [(1024, 4096, 512), (2048, 8192, 128)]
GRIDS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]  # (row, col, depth) on 4 ranks


class Counter:
    """Wraps torch.distributed's collectives and records (op, group size, elements) per call."""

    OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self.originals, self.active = dist, [], {}, False
        for op in self.OPS:
            self.originals[op] = getattr(dist, op)
            setattr(dist, op, self._wrap(op, self.originals[op]))

    def _wrap(self, op, fn):
        def counted(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                size = self.dist.get_world_size(group)
                first, second = args[0], args[1] if len(args) > 1 else None
                if op == "all_reduce":
                    numel = first.numel()
                elif op == "all_gather":
                    numel = sum(t.numel() for t in first)  # the gathered whole
                elif op == "reduce_scatter":
                    numel = sum(t.numel() for t in second)  # the whole that is reduced
                else:
                    numel = max(first.numel(), second.numel())
                self.calls.append((op.replace("_into_tensor", "").replace("_tensor", ""), size, numel))
            return fn(*args, **kwargs)
        return counted

    def restore(self):
        for op, fn in self.originals.items():
            setattr(self.dist, op, fn)


def ring_bytes(op: str, size: int, numel: int, elem: int = 4) -> float:
    factor = 2 * (size - 1) / size if op == "all_reduce" else (size - 1) / size
    return factor * numel * elem


def analytic_3d(hidden: int, ffn: int, tokens: int, grid, mlp: bool) -> int:
    """Elements handed to collectives per rank for one step of one 3D layer (or a 2-layer MLP)."""
    row, col, depth = grid
    local = tokens // depth

    def layer(d_in, d_out, transpose):
        out_n, in_n = (col, row) if transpose else (row, col)
        block = d_in * d_out // (out_n * in_n)
        total = 0
        total += 2 * block if depth > 1 else 0                              # weight all-gather + grad reduce-scatter
        total += local * d_out // out_n if in_n > 1 else 0                  # partial-sum all-reduce
        total += local * d_out if out_n > 1 else 0                          # output all-gather
        total += local * d_in // in_n if out_n > 1 else 0                   # input-grad all-reduce
        total += local * d_in if in_n > 1 else 0                            # input-grad all-gather
        total += d_out if depth > 1 else 0                                  # bias grad averaged over depth
        return total

    return layer(hidden, ffn, False) + (layer(ffn, hidden, True) if mlp else 0)


def analytic_1d(hidden: int, ffn: int, tokens: int, tp: int, mlp: bool) -> int:
    # one column-parallel layer with its output gathered: all-gather forward, all-reduce backward;
    # the MLP pair (column then row): one all-reduce forward, one backward
    # (plus the data-parallel gradient all-reduce when there are data ranks, counted by the caller)
    return 2 * tokens * hidden if mlp else tokens * ffn + tokens * hidden


def _data_parallel_sync(topology):
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors

    def sync(model):  # what DDP sends: every gradient all-reduced over the data ranks
        if topology.size("data") > 1:
            dist.all_reduce(_flatten_dense_tensors([p.grad for p in model.parameters()]), group=topology.group("data"))
    return sync


def _step(model, x, counter, sync=None):
    # The input needs a gradient, as a layer inside a model does (its backward collectives run).
    x = x.detach().requires_grad_()
    counter.active = True
    out = model(x)
    out.float().pow(2).mean().backward()
    if sync is not None:
        sync(model)
    counter.active = False


def measure(sizes=SIZES, grids=GRIDS) -> list[dict]:
    import torch.distributed as dist
    from torch import nn

    from atorch import intra_layer
    from atorch.distributed.topology import Topology
    from atorch.parallel_layers import ColumnParallelLinear, RowParallelLinear

    world = dist.get_world_size()
    counter = Counter()
    rows = []
    try:
        for hidden, ffn, tokens in sizes:
            configs = [("1D", (world, 1))] + ([("1D", (world // 2, 2))] if world % 2 == 0 else [])
            configs += [("3D", grid) for grid in grids if math.prod(grid) == world]
            for kind, grid in configs:
                for mlp in (False, True):
                    torch.manual_seed(0)
                    if kind == "1D":
                        # tensor x data ranks; the data ranks split the batch and average gradients (DDP)
                        topology = Topology.build([("tensor", grid[0]), ("data", grid[1])])
                        group = topology.group("tensor")
                        if mlp:
                            model = nn.Sequential(ColumnParallelLinear(hidden, ffn, gather_output=False, group=group),
                                                  nn.GELU(), RowParallelLinear(ffn, hidden, input_is_parallel=True,
                                                                               group=group))
                        else:
                            model = ColumnParallelLinear(hidden, ffn, gather_output=True, group=group)
                        x, sync = torch.randn(tokens // grid[1], hidden), _data_parallel_sync(topology)
                        expected = analytic_1d(hidden, ffn, tokens // grid[1], world, mlp)
                        expected += sum(p.numel() for p in model.parameters()) if grid[1] > 1 else 0
                    else:
                        topology = intra_layer.init(G_intra_r=grid[0], G_intra_c=grid[1], G_intra_d=grid[2])
                        layers = [intra_layer.Linear(hidden, ffn, topology=topology)]
                        if mlp:
                            layers += [nn.GELU(), intra_layer.Linear(ffn, hidden, transpose=True, topology=topology)]
                        model = nn.Sequential(*layers)
                        x = torch.randn(tokens // grid[2], hidden)  # the batch is split over depth
                        sync = intra_layer.sync_gradients
                        expected = analytic_3d(hidden, ffn, tokens, grid, mlp)
                    _step(model, x, counter, sync)  # warm-up, not counted
                    counter.calls.clear()
                    _step(model, x, counter, sync)
                    payload = sum(n for _, _, n in counter.calls)
                    by_op = {}
                    for op, size, numel in counter.calls:
                        by_op[f"{op}/{size}"] = by_op.get(f"{op}/{size}", 0) + numel * 4
                    weights = sum(p.numel() for p in model.parameters())
                    rows.append({
                        "hidden": hidden, "ffn": ffn, "tokens": tokens, "block": "MLP (2 layers)" if mlp else "Linear",
                        "algorithm": kind, "grid": "x".join(map(str, grid)), "collectives": len(counter.calls),
                        "payload_bytes": payload * 4, "expected_bytes": expected * 4,
                        "ring_bytes_sent": sum(ring_bytes(op, size, n) for op, size, n in counter.calls),
                        "by_op_bytes": by_op, "weight_elements_per_rank": weights,
                    })
    finally:
        counter.restore()
    return rows


def markdown(rows: list[dict], nproc: int) -> str:
    mib = lambda v: f"{v / 2**20:.1f}"  # noqa: E731
    lines = [f"| layer (hidden, ffn, tokens) | block | algorithm ({nproc} ranks) | layout (3D: row x col x depth) | collectives | "
             "payload MiB | ring MiB sent/rank | vs 1D | weights/rank (M) | matches formula |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["algorithm"] == "1D" and b["block"] == r["block"] and b["hidden"] == r["hidden"])
        tensor, _, data = r["grid"].partition("x")
        layout = r["grid"] if r["algorithm"] == "3D" else f"tensor {tensor}" + (f" x data {data}" if data != "1" else "")
        lines.append(
            f"| {r['hidden']}, {r['ffn']}, {r['tokens']} | {r['block']} | {r['algorithm']} | {layout} | {r['collectives']} | "
            f"{mib(r['payload_bytes'])} | {mib(r['ring_bytes_sent'])} | {r['ring_bytes_sent'] / base['ring_bytes_sent']:.2f} | "
            f"{r['weight_elements_per_rank'] / 1e6:.2f} | {'yes' if r['payload_bytes'] == r['expected_bytes'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/intra_layer_comm")
    parser.add_argument("--small", action="store_true", help="only the smaller layer size (quick)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from atorch.distributed.local import run_local

    sizes = SIZES[:1] if args.small else SIZES
    rows = run_local(measure, args.nproc, (sizes,), timeout_s=1800)[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/intra_layer_comm.py " + " ".join(sys.argv[1:])
    date = time.strftime("%Y-%m-%d", time.gmtime())
    out.with_suffix(".json").write_text(
        json.dumps({"command": command, "date": date, "nproc": args.nproc, "rows": rows}, indent=2) + "\n")
    table = markdown(rows, args.nproc)
    out.with_suffix(".md").write_text(f"`{command}` ({date}, torch {torch.__version__}, gloo, fp32)\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
