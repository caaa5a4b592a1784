"""Padded batches under the trainer integrations, against plain PyTorch on each whole global batch.

The serial reference trains a tiny model (dropout off, fp32) with SGD on each global batch of
right-padded sequences (tests/helpers/hf.PaddedTokens: 2 to 16 label tokens a sequence): its loss
is the global batch's token mean. A trainer on 2 gloo ranks splits each global batch over the
ranks and its accumulation micro-batches; trained exactly, it logs the same losses and ends on the
same weights. SGD, not AdamW: its update is the gradient itself, so a gradient weighted otherwise
shows in the weights at once. Clipping is off for the same reason (a norm clip hides a uniform
scale).
"""

import contextlib
import logging

import torch

GLOBAL, STEPS, LR = 8, 4, 0.5


@contextlib.contextmanager
def atorch_warnings():
    """The WARNING records of the ``atorch`` logger while inside (rank 0's: the others are filtered)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler, log = Keep(), logging.getLogger("atorch")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def tiny(family: str) -> torch.nn.Module:
    from tests.helpers.hf import tiny_bert, tiny_gpt2, tiny_llama

    return {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert}[family]()


class Blanked(torch.utils.data.Dataset):
    """PaddedTokens with the labels of the samples ``blank`` all -100 (a global batch of them
    counts nothing)."""

    def __init__(self, n: int, blank: list[int]):
        from tests.helpers.hf import PaddedTokens

        self.data, self.blank = PaddedTokens(n), set(blank)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        sample = self.data[i]
        return {**sample, "labels": torch.full_like(sample["labels"], -100)} if i in self.blank else sample


def dataset(steps: int = STEPS, empty: int | None = None, order: list[int] | None = None):
    """The padded data; ``empty``: the global batch of that step (read in ``order``) counts nothing."""
    from tests.helpers.hf import PaddedTokens

    if empty is None:
        return PaddedTokens(GLOBAL * steps)
    order = list(range(GLOBAL * steps)) if order is None else order
    return Blanked(GLOBAL * steps, order[empty * GLOBAL:(empty + 1) * GLOBAL])


def lightning_order(steps: int = STEPS) -> list[int]:
    """The order Lightning's DistributedSampler reads the training data in (it always shuffles
    them, seed 0, epoch 0): rank r's micro-batches take every W-th index from r on, so the ranks'
    micro-batches of one step are one block of GLOBAL consecutive entries of this order."""
    return torch.randperm(GLOBAL * steps, generator=torch.Generator().manual_seed(0)).tolist()


def global_batches(steps: int = STEPS, order: list[int] | None = None, empty: int | None = None) -> list[dict]:
    data = dataset(steps, empty, order)
    order = list(range(len(data))) if order is None else order
    keys = list(data[0])
    return [{k: torch.stack([data[i][k] for i in order[s * GLOBAL:(s + 1) * GLOBAL]]) for k in keys}
            for s in range(steps)]


def flat(state: dict) -> torch.Tensor:
    return torch.cat([state[name].detach().reshape(-1).float() for name in sorted(state)])


def serial(family: str = "llama", steps: int = STEPS, order: list[int] | None = None, empty: int | None = None
           ) -> dict:
    """Plain PyTorch on each whole global batch (the data read in ``order``, default as stored):
    its token-mean loss, the weights before and after. A batch without a label (``empty``) does
    not step (its loss is nan)."""
    model = tiny(family)
    before = flat(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(steps, order, empty):
        loss = model(**batch).loss
        losses.append(loss.item())
        if not (batch["labels"] != -100).any():
            continue
        loss.backward()
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "before": before, "after": flat(model.state_dict())}


def relative_change_error(after: torch.Tensor, reference: dict) -> float:
    """|w - w_serial| / |w_serial - w_start|: how far a run ended from the serial one, relative to
    how far the serial one moved."""
    moved = reference["after"] - reference["before"]
    return float((after - reference["after"]).norm() / moved.norm())


def loss_gap(losses: list[float], reference: dict) -> float:
    """The largest relative difference of two runs' step losses (a step without a label skipped)."""
    assert len(losses) == len(reference["losses"]), (losses, reference["losses"])
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]) if b == b)


def weights_of(model: torch.nn.Module) -> torch.Tensor:
    """The serial model's state dict as one tensor, whatever holds it (FSDP2 shards and
    tensor-parallel pieces gathered; collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from atorch import parallel_state
    from atorch.auto.context import unwrap
    from atorch.checkpoint.export import _full_state

    topology = parallel_state.current_topology()
    if topology is not None and parallel_state.get_tensor_model_parallel_size() > 1:
        return flat(_full_state(model))
    state = unwrap(model).state_dict()
    return flat({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()})


def train_hf(output_dir: str, strategy=None, accumulation: int = 1, family: str = "llama", plain: bool = False,
             average_tokens: bool = True, data_size: int = 2, steps: int = STEPS, empty: int | None = None) -> dict:
    """The Trainer (``plain``) or AtorchTrainer on the padded data: each global batch of GLOBAL
    sequences read in order, split over ``data_size`` data ranks and ``accumulation``
    micro-batches. The losses it logs (every step) and the weights after."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs_=None, **kwargs):
            logs.append(dict(kwargs.get("logs") or logs_ or {}))

    args = TrainingArguments(
        output_dir, per_device_train_batch_size=GLOBAL // (data_size * accumulation),
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, train_sampling_strategy="sequential",
        average_tokens_across_devices=average_tokens, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_drop_last=True)
    kwargs = dict(model=tiny(family), args=args, train_dataset=dataset(steps, empty), callbacks=[Record()])
    if plain:
        trainer = Trainer(**kwargs)
    else:
        from atorch.integrations.transformers import AtorchTrainer

        trainer = AtorchTrainer(strategy=strategy, **kwargs)
    with atorch_warnings() as warnings:
        trainer.train()
    model = trainer.model if plain else trainer._result.model
    return {"losses": [entry["loss"] for entry in logs if "loss" in entry], "after": weights_of(model),
            "warnings": warnings}


def _count(family: str, batch: dict) -> torch.Tensor:
    labels = batch["labels"][:, 1:] if family in ("llama", "gpt2") else batch["labels"]
    return (labels != -100).sum()


def _global_losses(parts: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> list[float]:
    """Each step's token mean over every rank's parts (loss x count summed, over the count)."""
    import torch.distributed as dist

    totals = torch.stack([torch.stack([loss.double() * count, count.double()]) for loss, count in parts])
    totals = totals.reshape(steps, -1, 2).sum(1)
    dist.all_reduce(totals)
    return [float(total / count) for total, count in totals]


def train_lightning(output_dir: str, strategy=None, accumulation: int = 1, family: str = "llama",
                    normalization: str = "tokens", data_size: int = 2, steps: int = STEPS, with_count: bool = False,
                    empty: int | None = None) -> dict:
    """A LightningModule whose training_step returns the model's ``out.loss`` (or, ``with_count``, a
    custom token mean marked with ``atorch.with_count``), under AtorchStrategy or (``strategy``
    None) Lightning's own DDP. Each step's global token mean and the weights after."""
    import lightning as L
    import torch.nn.functional as F

    parts: list = []

    class PaddedLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny(family)

        def forward(self, **inputs):  # through the module's own call: FSDP2 unshards its root there
            return self.model(**inputs)

        def training_step(self, batch, batch_idx):
            count = _count(family, batch)
            if with_count:
                import atorch

                out = self(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
                loss = atorch.with_count(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)),
                                         count)
            else:
                loss = self(**batch).loss
            parts.append((loss.detach(), count))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    if strategy is None:
        from lightning.pytorch.strategies import DDPStrategy

        lightning_strategy = DDPStrategy(process_group_backend="gloo")
    else:
        from atorch.integrations.lightning import AtorchStrategy

        lightning_strategy = AtorchStrategy(strategy, loss_normalization=normalization)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=lightning_strategy, max_steps=steps,
                        accumulate_grad_batches=accumulation, default_root_dir=output_dir, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(dataset(steps, empty, lightning_order(steps)),
                                         batch_size=GLOBAL // (data_size * accumulation))
    with atorch_warnings() as warnings:
        trainer.fit(PaddedLM(), loader)
    # (Tensor-parallel ranks hold the same parts: summed twice, their ratio is the same.)
    return {"losses": _global_losses(parts, steps), "after": weights_of(trainer.strategy.model), "warnings": warnings}


def train_fabric(output_dir: str, strategy=None, accumulation: int = 1, normalization: str = "tokens",
                 divide: bool = False, data_size: int = 2, steps: int = STEPS, empty: int | None = None) -> dict:
    """A Fabric loop: ``fabric.backward(model(**batch).loss)`` on each micro-batch (``divide``: the
    loss divided by the accumulation steps first, the usual per-part mean), under
    AtorchFabricStrategy or (``strategy`` None) Fabric's own DDP. Each step's global token mean and
    the weights after."""
    import lightning as L

    if strategy is None:
        from lightning.fabric.strategies import DDPStrategy

        fabric_strategy = DDPStrategy(process_group_backend="gloo")
    else:
        from atorch.integrations.fabric import AtorchFabricStrategy

        fabric_strategy = AtorchFabricStrategy(strategy, loss_normalization=normalization)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy)
    fabric.launch()
    model = tiny("llama")
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(
        dataset(steps, empty), batch_size=GLOBAL // (data_size * accumulation)))
    batches, parts = iter(loader), []
    with atorch_warnings() as warnings:
        for _ in range(steps):
            for i in range(accumulation):
                batch = next(batches)
                with fabric.no_backward_sync(model, enabled=i < accumulation - 1):
                    loss = model(**batch).loss
                    fabric.backward(loss / accumulation if divide else loss)
                parts.append((loss.detach(), _count("llama", batch)))
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": _global_losses(parts, steps), "after": weights_of(model._forward_module), "warnings": warnings}
