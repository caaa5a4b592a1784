"""A small chain model and its serial reference run, shared by the pipeline tests."""

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, CLASSES, BATCH, STEPS, LR = 8, 16, 4, 8, 5, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def chain_model(layers: int = 4, seed: int = 0, device=None) -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return nn.Sequential(nn.Linear(IN, HIDDEN), *(Block() for _ in range(layers)), nn.Linear(HIDDEN, CLASSES))


def batches(steps: int = STEPS):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
            for _ in range(steps)]


def chain_loss(batch, output):
    return F.cross_entropy(output, batch["target"])


def serial_losses(layers: int = 4) -> list[float]:
    model = chain_model(layers)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        loss = chain_loss({"target": y}, model(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def pipeline_losses(model, steps: int = STEPS, input_name: str = "input") -> list[float]:
    """Train a PipelineModel (built with broadcast_and_average_loss=True) with SGD; losses on every rank."""
    optim = torch.optim.SGD(model.local_parameters(), lr=LR)
    losses = []
    for x, y in batches(steps):
        losses.append(model.run_train(**{input_name: x}, target=y).item())
        optim.step()
        optim.zero_grad()
    return losses


def train_pipelined(load_strategy, steps: int = 5) -> dict:
    """The training loop of docs/pipeline.md over a tiny Llama; the losses every rank sees and the
    first step's gradient norm."""
    import atorch
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens, tiny_llama

    _, result, strategy = auto_accelerate(
        tiny_llama(), torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", load_strategy=load_strategy,
    )
    losses, batches = [], iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(batches), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        if not result.args.get("backward_in_forward"):
            loss.backward()
        if not losses:  # the whole model's gradient norm at the first step (max_norm too large to clip)
            from atorch.auto import clip_grad_norm

            norm = clip_grad_norm(result.model, 1e9).item()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(loss.item())
    local = sum(p.numel() for p in result.optim.param_groups[0]["params"])
    kinds = sorted({type(m).__name__ for _, m in result.model.local_named_modules() if "Parallel" in type(m).__name__})
    return {"losses": losses, "strategy": strategy.to_json(), "optim_numel": local, "parallel_modules": kinds,
            "norm": norm, "schedule_class": type(result.model._schedule).__name__}


class ChainData(torch.utils.data.Dataset):
    """The samples of :func:`batches`, in order: a dataloader of batch 8 serves the same steps."""

    def __init__(self):
        self.items = [(x[i], y[i]) for x, y in batches() for i in range(BATCH)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input": self.items[i][0], "target": self.items[i][1]}


def train_chain(load_strategy, steps: int = STEPS, **kwargs) -> dict:
    """The chain model through auto_accelerate with the pipeline training loop; every rank's losses."""
    import atorch
    from atorch.auto import auto_accelerate

    _, result, strategy = auto_accelerate(
        chain_model(), torch.optim.SGD, ChainData(), chain_loss, optim_args={"lr": LR},
        dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict", load_strategy=load_strategy,
        **kwargs)
    losses, data = [], iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(data), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        if not result.args.get("backward_in_forward"):
            loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "strategy": strategy.to_json(), "args": dict(result.args), "notes": list(result.notes)}


def four_rank_runs():
    """PipelineModel on 4 ranks: 8 stages interleaved, and pipeline 2 x data 2; every rank's losses."""
    from atorch.distributed.topology import Topology
    from atorch.pipeline import PipelineModel

    out = {}
    # 8 stages, two per rank: interleaved 1F1B
    model = PipelineModel(chain_model(6), num_microbatches=4, virtual_pipeline_size=2, auto_partition=True,
                          broadcast_and_average_loss=True, loss_fn=chain_loss, schedule="interleaved")
    out["interleaved"] = pipeline_losses(model)
    # pipeline 2 x data 2: each data rank trains on its half of the batch
    topology = Topology.build([("pipeline", 2), ("data", 2)])
    model = PipelineModel(chain_model(6), num_microbatches=2, auto_partition=True, broadcast_and_average_loss=True,
                          loss_fn=chain_loss, topology=topology)
    optim = torch.optim.SGD(model.local_parameters(), lr=0.1)
    half, losses = topology.data_parallel_rank, []
    for x, y in batches():
        part = slice(half * 4, half * 4 + 4)
        losses.append(model.run_train(input=x[part], target=y[part]).item())
        optim.step()
        optim.zero_grad()
    out["pp2_dp2"] = losses
    return out


class LoopNet(nn.Module):
    """The way most people write a model: a plain module whose forward loops over a ModuleList of
    blocks (no layout knows it: PipelineModel splits it by tracing)."""

    def __init__(self, layers: int = 4, stop_on_data: bool = False):
        super().__init__()
        self.stop_on_data = stop_on_data
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            if self.stop_on_data and h.abs().max() > 100:  # data-dependent: cannot be traced
                break
            h = block(h)
        return self.head(h)


def loop_model(layers: int = 4, seed: int = 0, **kwargs) -> LoopNet:
    torch.manual_seed(seed)
    return LoopNet(layers, **kwargs)


def serial_losses_of(model: nn.Module, steps: int = STEPS, lr: float = LR, optimizer=torch.optim.SGD) -> list[float]:
    """SGD on ``model`` over :func:`batches` with :func:`chain_loss`: the reference of a pipelined run."""
    optim = optimizer(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(steps):
        loss = chain_loss({"target": y}, model(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def token_batches(steps: int = STEPS, masked: bool = False):
    """``steps`` batches of 8 sequences of the tiny Hugging Face vocabulary: causal LM labels, or
    masked-LM labels with 4 predicted positions per sequence (the same count in every sequence, so
    a mean over microbatch means is the whole batch's mean, as in the serial model)."""
    from tests.helpers.hf import SEQ, VOCAB

    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = ids.clone()
        if masked:
            keep = torch.rand(BATCH, SEQ, generator=gen).argsort(dim=1)[:, :4]
            labels = torch.full_like(ids, -100).scatter(1, keep, ids.gather(1, keep))
        out.append({"input_ids": ids, "labels": labels})
    return out


def hf_serial_losses(model, steps: int = STEPS, masked: bool = False, lr: float = LR) -> list[float]:
    from tests.helpers.models import serial_steps

    return serial_steps(model, torch.optim.SGD(model.parameters(), lr=lr), token_batches(steps, masked))


def hf_pipeline_losses(model, steps: int = STEPS, masked: bool = False) -> list[float]:
    optim = torch.optim.SGD(model.local_parameters(), lr=LR)
    losses = []
    for batch in token_batches(steps, masked):
        losses.append(model.run_train(**batch).item())
        optim.step()
        optim.zero_grad()
    return losses


class HiddenLayout(nn.Module):
    """A Hugging Face LM behind a wrapper no layout matches, so PipelineModel traces it."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    @property
    def loss_function(self):
        return self.lm.loss_function

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids)


class _NoGradTable(nn.Module):
    """A rotary-style table computed under torch.no_grad, as Llama's rotary_emb was before
    transformers 5.24: torch.export's unflattening loses its input once the program is cut."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("freq", torch.arange(float(width)), persistent=False)

    @torch.no_grad()
    def forward(self, hidden, position_ids):
        return (position_ids[..., None].float() * self.freq).cos().to(hidden.dtype)


class _TableBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, hidden, table):
        return hidden + self.linear(hidden) * table


class NoGradTableModel(nn.Module):
    """Traces, but its program cut into two stages does not run (see ``_NoGradTable``)."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([_TableBlock(width), _TableBlock(width)])
        self.table = _NoGradTable(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        table = self.table(hidden, position_ids=torch.arange(input_ids.shape[1], device=input_ids.device)[None])
        for layer in self.layers:
            hidden = layer(hidden, table)
        return self.head(hidden)


def train_loop_model(load_strategy, steps: int = STEPS) -> dict:
    """The ModuleList model through auto_accelerate with the pipeline training loop (its forward
    takes ``x``); every rank's losses."""
    import atorch
    from atorch.auto import auto_accelerate

    class Data(ChainData):
        def __getitem__(self, i):
            return {"x": self.items[i][0], "target": self.items[i][1]}

    _, result, _ = auto_accelerate(loop_model(), torch.optim.SGD, Data(), chain_loss, optim_args={"lr": LR},
                                   dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict",
                                   load_strategy=load_strategy)
    losses, data = [], iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(data), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.step()
        result.optim.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "args": dict(result.args)}
