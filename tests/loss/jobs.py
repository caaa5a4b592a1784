"""Training jobs for the loss-normalization tests: the serial whole-batch reference and the same
job through auto_accelerate on gloo ranks (module-level, so spawned ranks can run them).

SGD, not AdamW: its update is the gradient itself, so a gradient scaled or weighted otherwise
shows in the weights at once (AdamW divides most of a uniform scale away).
"""

import torch
import torch.nn.functional as F

BATCH, STEPS, LR = 8, 3, 0.5


def dataset(mask: bool | str = True):
    """Padded batches with their attention mask, without it (``False``), with a second global
    batch that counts nothing (``"empty"``), or whose first half counts nothing (``"half"``)."""
    from tests.helpers.hf import EmptySecondBatch, PaddedTokens, UnmaskedPadding

    if mask == "half":
        return EmptySecondBatch(empty=(8, 12))
    return {True: PaddedTokens, False: UnmaskedPadding, "empty": EmptySecondBatch}[mask]()


def global_batches(mask: bool | str = True, steps: int = STEPS) -> list[dict]:
    data = dataset(mask)
    keys = list(data[0])
    return [{k: torch.stack([data[i][k] for i in range(s * BATCH, (s + 1) * BATCH)]) for k in keys}
            for s in range(steps)]


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())])


def serial(mask: bool | str = True, steps: int = STEPS) -> dict:
    """Plain PyTorch on each whole global batch: its token-mean loss, and the weights after."""
    from tests.helpers.hf import tiny_llama

    model = tiny_llama()
    before = flat_weights(model)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(mask, steps):
        loss = model(**batch).loss
        if not (batch["labels"] != -100).any():  # nothing to learn from: no step (atorch's rule)
            losses.append(None)
            continue
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "before": before, "after": flat_weights(model)}


def token_sum_loss(batch, out):
    """A loss atorch cannot see into, saying what it counts (the contract)."""
    from atorch.loss import TokenSum

    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")
    return TokenSum(total, (labels != -100).sum())


def model_loss(batch, out):
    return out.loss


def custom_mean_loss(batch, out):
    """A loss atorch cannot see into, without a count: weighted as one per part."""
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def train(strategy, mask: bool | str = True, accumulation: int = 1, normalization: str = "tokens",
          loss_func=model_loss, steps: int = STEPS, batch_size: int = BATCH) -> dict:
    """The job through auto_accelerate and the README's loop: per step, the reported loss and
    counts; the full weights at the end (gathered from shards and stages)."""
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import tiny_llama

    model = tiny_llama()
    _, result, _ = auto_accelerate(
        model, torch.optim.SGD, dataset(mask), loss_func, optim_args={"lr": LR},
        dataloader_args={"batch_size": batch_size}, model_input_format="unpack_dict", load_strategy=strategy,
        gradient_accumulation_steps=accumulation, loss_normalization=normalization)
    it, steps_out = iter(result.dataloader), []
    for _ in range(steps):
        stepped = False
        while not stepped:
            batch = result.prepare_input(next(it), torch.device("cpu"))
            result.backward(result.loss_func(batch, result.model(**batch)))
            stepped = result.sync_gradients
            result.step()
        steps_out.append(result.last_step)
    pipelined = result.args.get("backward_in_forward", False)
    return {"steps": steps_out, "after": None if pipelined else full_weights(model),
            "skipped": result.loss_tokens.skipped}


def full_weights(model: torch.nn.Module) -> torch.Tensor:
    """The user's model's weights as one tensor (DTensor shards gathered). Not for pipelines: a
    rank holds only its stages' units up to date."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).float()
                      for _, p in sorted(model.named_parameters())])


def relative_change_error(after: torch.Tensor, reference: dict) -> float:
    """|w - w_serial| / |w_serial - w_start|: how far the training went from the serial one,
    relative to how far the serial one went (the issue's "weight change vs serial")."""
    moved = reference["after"] - reference["before"]
    return float((after - reference["after"]).norm() / moved.norm())
