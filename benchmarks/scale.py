"""Per-rank memory of 1B and 7B Llama models at 8, 64 and 512 ranks, on paper.

    .venv/bin/python benchmarks/scale.py --world-sizes 8,64,512

One process plays rank 0 of a large job over a *fake* process group (torch's ``fake`` backend:
collectives return at once, nothing is sent). The model is built on the meta device, so no
memory is allocated, and each strategy's sharding code runs for real:
- ``fsdp``: ``fully_shard`` per decoder layer and at the root, over a mesh of the whole world;
  the rank's parameters are its DTensor shards (with FSDP2's padding of dim 0 to the world size);
- ``zero1``: ``ZeroRedundancyOptimizer``'s own partition of the parameters between ranks (it
  assigns whole tensors, so ranks are uneven);
- ``zero2``: ``fully_shard`` as zero2 applies it (``reshard_after_forward=False``): parameters,
  gradients and optimizer state are sharded between steps, and every unit's parameters are
  gathered in forward and stay gathered until its backward;
- ``ddp``: everything replicated.
Per strategy: ``params`` (kept between steps: the rank's shards), ``gathered`` (parameters
unsharded at the peak between forward and backward: FSDP2 all-gathers a unit's padded shards into
one buffer of world x shard elements; zero2 holds every unit's, fsdp the root's and one block's),
``grads`` and ``optim``. Columns side by side: at rest, peak (with ``gathered``), atorch's cost
model (what ``atorch plan`` and the search use), and the textbook formula. fp32 weights and
gradients, AdamW (two fp32 moments). Activations do not depend on these strategies and are left
to ``atorch plan``.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

CONFIGS = {
    "llama-1b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
                 "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4},
    "llama-7b": json.loads((harness.ROOT / "docs" / "plans" / "llama7b.json").read_text()),
    # A toy for the test suite.
    "tiny": {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 176,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
}
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
GIB = 2**30


def meta_model(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIGS[name])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def fake_world(world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _local(param) -> int:
    from torch.distributed.tensor import DTensor

    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _unit_gathered(unit: torch.nn.Module, world_size: int) -> int:
    """Elements FSDP2 allocates to unshard ``unit``'s own parameters: world x its padded shards.

    Rank 0 holds the largest (padded) shard of every tensor, so world x rank 0's shard is the
    all-gather output. Parameters of nested units are theirs, not this unit's.
    """
    nested = {id(p) for child in unit.modules() if child is not unit and hasattr(child, "unshard")
              for p in child.parameters()}
    return world_size * sum(_local(p) for p in unit.parameters() if id(p) not in nested)


def _sharded(name: str, world_size: int, reshard_after_forward: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = meta_model(name)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def sharded_counts(name: str, world_size: int) -> dict[str, dict[str, int]]:
    """Elements per rank (params, gathered, grads, optimizer moments) from the sharding code."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    fake_world(world_size)
    try:
        total = sum(p.numel() for p in meta_model(name).parameters())
        out = {"ddp": {"params": total, "gathered": 0, "grads": total, "optim": 2 * total}}

        model = meta_model(name)
        zero = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW)
        mine = sum(p.numel() for p in zero._partition_parameters()[0][0]["params"])
        out["zero1"] = {"params": total, "gathered": 0, "grads": total, "optim": 2 * mine}

        for strategy, reshard in (("fsdp", True), ("zero2", False)):
            model = _sharded(name, world_size, reshard)
            local = sum(_local(p) for p in model.parameters())
            units = [model, *model.model.layers]
            if reshard:  # fsdp: the root stays gathered from forward to backward, blocks one at a time
                gathered = _unit_gathered(model, world_size) + max(_unit_gathered(u, world_size) for u in units[1:])
            else:  # zero2: every unit stays gathered until its backward
                gathered = sum(_unit_gathered(u, world_size) for u in units)
            out[strategy] = {"params": local, "gathered": gathered, "grads": local, "optim": 2 * local}
        return out
    finally:
        dist.destroy_process_group()


def cost_model(name: str, world_size: int) -> dict[str, dict[str, int]]:
    """atorch's estimate of the same three quantities (bytes / 4 = elements)."""
    from atorch.auto.search.cost import estimate_memory
    from atorch.auto.strategy import Strategy

    model = meta_model(name)
    out = {}
    for strategy in STRATEGIES:
        methods = ["parallel_mode"] + ([] if strategy == "ddp" else [strategy])
        est = estimate_memory(model, Strategy(methods), world_size, 2.0, 0)
        out[strategy] = {"params": est.params // 4, "grads": est.grads // 4, "optim": est.optim_state // 4}
    return out


def by_hand(total: int, world_size: int) -> dict[str, dict[str, int]]:
    """The textbook ZeRO stages: N parameters, sharded terms N / world; zero2 gathers all N."""
    shard = math.ceil(total / world_size)
    return {"ddp": {"params": total, "gathered": 0, "grads": total, "optim": 2 * total},
            "zero1": {"params": total, "gathered": 0, "grads": total, "optim": 2 * shard},
            "zero2": {"params": shard, "gathered": total, "grads": shard, "optim": 2 * shard},
            "fsdp": {"params": shard, "gathered": 0, "grads": shard, "optim": 2 * shard}}


def run(names: list[str], world_sizes: list[int]) -> list[dict]:
    rows = []
    for name in names:
        total = sum(p.numel() for p in meta_model(name).parameters())
        for world in world_sizes:
            measured, model, hand = sharded_counts(name, world), cost_model(name, world), by_hand(total, world)
            for strategy in STRATEGIES:
                def gib(counts, keys=("params", "gathered", "grads", "optim")):
                    return 4 * sum(counts[strategy].get(k, 0) for k in keys) / GIB
                rows.append({"model": name, "params": total, "world_size": world, "strategy": strategy,
                             "measured": measured[strategy], "cost_model": model[strategy], "hand": hand[strategy],
                             "at_rest_gib": gib(measured, ("params", "grads", "optim")),
                             "measured_gib": gib(measured), "cost_model_gib": gib(model), "hand_gib": gib(hand)})
    return rows


def report(rows: list[dict], out: str, plot: str | None) -> str:
    body = [[r["model"], f"{r['params'] / 1e9:.2f}B", r["world_size"], r["strategy"], f"{r['at_rest_gib']:.3f}",
             f"{r['measured_gib']:.3f}", f"{r['cost_model_gib']:.3f}", f"{r['hand_gib']:.3f}",
             f"{r['cost_model_gib'] / r['measured_gib']:.3f}"]
            for r in rows]
    markdown = harness.table(["model", "params", "ranks", "strategy", "sharded at rest GiB", "sharded peak GiB",
                              "cost model GiB", "by hand GiB", "cost model / peak"], body)
    harness.write(out, {"rows": rows, "note": "params (+ gathered at the peak) + grads + AdamW moments per rank, fp32"},
                  markdown)
    if plot:
        _plot(rows, plot)
    return markdown


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for strategy in STRATEGIES:
            pts = [(r["world_size"], r["measured_gib"]) for r in rows if r["model"] == model and r["strategy"] == strategy]
            ax.plot(*zip(*pts), marker="o", label=strategy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("peak GiB per rank (params+grads+AdamW)")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-1b,llama-7b", help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--world-sizes", default="8,64,512")
    parser.add_argument("--out", default=str(harness.RESULTS / "scale"))
    parser.add_argument("--plot", default=str(harness.IMAGES / "scale.png"))
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(CONFIGS)}")
    markdown = report(run(names, [int(w) for w in args.world_sizes.split(",")]), args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
