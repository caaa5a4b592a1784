"""Train an MLP with 3D tensor parallelism (atorch.intra_layer, the AxoNN algorithm), no model change.

    torchrun --nproc_per_node=4 examples/train_intra_layer.py --row 2 --depth 2
    torchrun --nproc_per_node=4 examples/train_intra_layer.py --row 2 --col 2 --check

The model is written with plain nn.Linear; built under auto_parallelize, each Linear whose sizes
divide the grid is split over row x column x depth ranks. --check also trains the serial model
on every rank and prints both losses (they agree to about 1e-6).
"""

import argparse
import functools

import torch
from torch import nn

import atorch
import atorch.intra_layer as intra_layer
from atorch.data import create_dataloader


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(32, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.LayerNorm(hidden),
                         nn.GELU(), nn.Linear(hidden, 10))


def train(model, loader, steps, sync=None, clip=None):
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _, (x, y) in zip(range(steps), loader):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if sync:
            sync(model)
        clip(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", type=int, default=1)
    parser.add_argument("--col", type=int, default=1)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--check", action="store_true", help="also train the serial model and compare")
    args = parser.parse_args()

    atorch.init_distributed()
    tensor = args.row * args.col * args.depth
    topology = intra_layer.init(G_data=atorch.world_size() // tensor, G_intra_r=args.row, G_intra_c=args.col,
                                G_intra_d=args.depth)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32, generator=gen), torch.randint(0, 10, (512,), generator=gen))

    torch.manual_seed(0)
    serial = build_model(args.hidden)
    with intra_layer.auto_parallelize():
        model = build_model(args.hidden)
    model.load_state_dict(serial.state_dict())  # full weights: each 3D layer keeps its shard
    # --check compares with the serial model on the same batches: no shuffling then
    loader = create_dataloader(data, args.global_batch, shuffle=not args.check)
    # each rank's loss is the mean over its share: mean=True makes the gradients the serial model's
    sync = functools.partial(intra_layer.sync_gradients, mean=True)
    losses = train(model, loader, args.steps, sync, intra_layer.clip_grad_norm_)
    reference = None
    if args.check:
        reference = train(serial, torch.utils.data.DataLoader(data, batch_size=args.global_batch), args.steps,
                          clip=torch.nn.utils.clip_grad_norm_)
    if atorch.rank() == 0:
        print(f"grid: {topology}, split {topology.tensor_split} (row, col, depth), "
              f"{sum(isinstance(m, intra_layer.Linear) for m in model.modules())} 3D layers")
    for step, loss in enumerate(losses):
        loss = loss.clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)  # the mean over data x depth ranks: the global batch's loss
        if atorch.rank() == 0:
            line = f"step {step:3d} loss {loss.item() / atorch.world_size():.6f}"
            print(line + (f" serial {reference[step].item():.6f}" if reference else ""))
    atorch.shutdown()  # every rank leaves together, so a finished job exits 0


if __name__ == "__main__":
    main()
