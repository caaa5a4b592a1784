"""The CUDA tests' job: a small Llama (every Linear's dims multiples of 16, so fp8 can take them
all) learning counting sequences on the GPU through auto_accelerate, with its losses.

A run is compared with its reference (fp32, or eager) by :func:`assert_tracks`: the two loss
curves, each averaged over windows of ``window`` steps (1: step by step; the lower precisions
compare windows of WINDOW), are nowhere further apart than ``share`` of
what the reference learned over the run (its first loss minus its last). A run that did not train
(lr=0) is most of a drop away by the last window, so any share well below 1 tells it apart.

Why windows: at this learning rate the last steps' losses swing from step to step (1.26, 1.38,
1.50 in fp32), and a rounding difference moves a swing by a step. On the first GPU run (one H200,
2026-11-26) bf16 amp's worst single step strayed 0.064 of the drop and fp16's 0.022, while their
5-step windows strayed 0.022 and 0.005, and their first 10 steps 0.019 and 0.005. A failure prints
both curves.
"""

import torch

import atorch
from atorch.auto import auto_accelerate
from tests.helpers.models import linear_dtypes

VOCAB, SEQ, BATCH, STEPS, LR = 128, 32, 8, 20, 1e-2
WINDOW = 5  # steps a lower precision's loss curve is averaged over before it is compared (see above)


def small_llama(hidden: int = 64, layers: int = 2, seq: int = SEQ, attention: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         attn_implementation=attention)
    return LlamaForCausalLM(config)


class Counting(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = SEQ):
        start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (start + torch.arange(seq)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(strategy, steps: int = STEPS, lr: float = LR, model=None, seq: int = SEQ, batch: int = BATCH) -> dict:
    """Train on the GPU with ``strategy``; the losses, the applied strategy, its notes, the dtypes
    the Linear layers computed in, and the result (model, optimizer) to look into."""
    model = small_llama() if model is None else model
    status, result, applied = auto_accelerate(
        model, torch.optim.AdamW, Counting(seq=seq), lambda b, out: out.loss, optim_args={"lr": lr},
        dataloader_args={"batch_size": batch}, model_input_format="unpack_dict", load_strategy=strategy)
    assert status
    assert atorch.device().type == "cuda" and next(result.model.parameters()).is_cuda
    losses = []
    batches = _forever(result.dataloader)
    with linear_dtypes(result.model) as dtypes:
        for _ in range(steps):
            data = result.prepare_input(next(batches), atorch.device())
            loss = result.loss_func(data, result.model(**data))
            result.backward(loss)
            result.step()
            losses.append(loss.item())
    return {"losses": losses, "strategy": applied.opt_names, "notes": list(result.notes), "dtypes": dtypes,
            "result": result}


def _forever(loader):
    while True:
        yield from loader


def assert_tracks(actual: list[float], reference: list[float], share: float, window: int = 1) -> None:
    drop = reference[0] - reference[-1]
    assert drop > 1.0, f"the reference hardly trained ({reference[0]:.3f} -> {reference[-1]:.3f}): no effect to compare"
    gap = max(abs(a - r) for a, r in zip(windowed(actual, window), windowed(reference, window), strict=True))
    assert gap <= share * drop, (f"the run's {window}-step means stray {gap:.4g} from its reference's, {gap / drop:.3g} "
                                 f"of the reference's drop {drop:.3f} (allowed {share})\nrun:       {actual}\n"
                                 f"reference: {reference}")


def windowed(losses: list[float], window: int) -> list[float]:
    """The means of consecutive windows of ``window`` losses (a shorter last one included).

    >>> windowed([4.0, 2.0, 3.0, 1.0, 5.0], 2)
    [3.0, 2.0, 5.0]
    """
    return [sum(losses[i:i + window]) / len(losses[i:i + window]) for i in range(0, len(losses), window)]
