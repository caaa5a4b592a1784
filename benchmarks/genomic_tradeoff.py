"""Genomic bottleneck: compression ratio against final loss, for a few g-net sizes.

    python benchmarks/genomic_tradeoff.py --steps 300 --out benchmarks/results/genomic_tradeoff \
        --plot docs/images/genomic_tradeoff.png

Trains the character-level language model of the tests (2 transformer blocks of width 64,
98,304 weights in its attention and MLP matrices) on a repeated fixed text, once with every weight
trained directly and once per g-net size, all from the same initialization, data order and
learning rates (Adam, 3e-3, for the directly trained parameters and for the g-nets). Reports the
compression ratio (covered weights over g-net parameters) and the loss on held-out windows at the
end. One process, one thread: about a minute of CPU.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (tile_size, gnet_width, gnet_depth), from the largest g-nets to the smallest.
SIZES = [(16, 32, 2), (32, 32, 2), (32, 32, 1), (64, 32, 1), (64, 16, 1), (64, 8, 1)]
LR = 3e-3


def train(size: tuple[int, int, int] | None, steps: int, batch: int) -> dict:
    from atorch.compression import GenomicBottleneck
    from tests.compression.models import CharLM, char_batches, lm_loss

    model = CharLM()
    gnets = None
    if size is not None:
        tile, width, depth = size
        gnets = GenomicBottleneck(model, tile_size=tile, gnet_width=width, gnet_depth=depth, optimizer_args={"lr": LR})
    optim = torch.optim.Adam(gnets.direct_parameters() if gnets else model.parameters(), lr=LR)
    start = time.perf_counter()
    for window in char_batches(steps, batch):
        optim.zero_grad()
        if gnets:
            gnets.zero_grad()
            gnets.predict_weights()
        lm_loss(model, window).backward()
        if gnets:
            gnets.backward()
        optim.step()
        if gnets:
            gnets.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        if gnets:
            gnets.predict_weights()
        held_out = [lm_loss(model, w).item() for w in char_batches(8, 64, seed=99)]
    covered = gnets.covered_numel() if gnets else 0
    # What the optimizers update: the g-nets plus every parameter no g-net covers.
    direct = sum(p.numel() for p in (gnets.direct_parameters() if gnets else model.parameters()))
    return {
        "tile_size": size[0] if size else None, "gnet_width": size[1] if size else None,
        "gnet_depth": size[2] if size else None, "covered_weights": covered,
        "gnet_params": gnets.gnet_numel() if gnets else None, "direct_params": direct,
        "trained_params": direct + (gnets.gnet_numel() if gnets else 0),
        "compression_ratio": gnets.compression_ratio() if gnets else 1.0,
        "final_loss": sum(held_out) / len(held_out), "seconds": seconds,
    }


def write_markdown(rows: list[dict], path: Path, steps: int, batch: int) -> None:
    """``compression`` is covered weights over g-net parameters; ``fewer trained`` counts all that
    the optimizers update (g-nets plus the parameters trained directly) against the baseline's."""
    baseline = next((r["trained_params"] for r in rows if r["tile_size"] is None), None)
    lines = [
        f"# Genomic bottleneck: compression vs loss (char LM, {steps} steps of {batch} windows)", "",
        "| g-nets (tile, width, depth) | g-net params | compression | trained params (g-nets + direct) "
        "| fewer trained | held-out loss | train s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        label = "none (all weights trained)" if row["tile_size"] is None else (
            f"{row['tile_size']}, {row['gnet_width']}, {row['gnet_depth']}")
        params = "-" if row["gnet_params"] is None else f"{row['gnet_params']:,}"
        fewer = "-" if baseline is None else f"{baseline / row['trained_params']:.1f}x"
        lines.append(f"| {label} | {params} | {row['compression_ratio']:.1f}x | {row['trained_params']:,} | {fewer} "
                     f"| {row['final_loss']:.3f} | {row['seconds']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    compressed = [r for r in rows if r["tile_size"] is not None]
    for depth, marker in ((1, "o"), (2, "s")):
        points = [r for r in compressed if r["gnet_depth"] == depth]
        ax.scatter([r["compression_ratio"] for r in points], [r["final_loss"] for r in points], marker=marker,
                   label=f"g-nets of depth {depth}")
    for r in compressed:
        ax.annotate(f"{r['tile_size']}/{r['gnet_width']}/{r['gnet_depth']}", (r["compression_ratio"], r["final_loss"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    baseline = [r for r in rows if r["tile_size"] is None]
    if baseline:
        ax.axhline(baseline[0]["final_loss"], color="gray", linestyle="--", label="all weights trained directly")
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (covered weights / g-net parameters)")
    ax.set_ylabel("held-out loss (nats/char)")
    ax.set_title("Genomic bottleneck on a character LM (tile/width/depth)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/genomic_tradeoff")
    parser.add_argument("--plot", default="docs/images/genomic_tradeoff.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in [None, *SIZES]:
        rows.append(train(size, args.steps, args.batch))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"steps": args.steps, "batch": args.batch, "rows": rows}, indent=1))
    write_markdown(rows, out.with_suffix(".md"), args.steps, args.batch)
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
