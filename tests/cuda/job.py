"""The CUDA tests' job: a small Llama (every Linear's dims multiples of 16, so fp8 can take them
all) learning counting sequences on the GPU through auto_accelerate, with its losses.

A run is compared with its reference (fp32, or eager) by :func:`assert_tracks`: the largest gap
between the two loss curves is at most ``share`` of what the reference learned over the run
(its first loss minus its last). A run that did not train (lr=0) is a whole drop away at the end,
so any share below 1 tells it apart; a share set well below the effect under test is the check.
The shares are first guesses, to be measured on the first GPU run (benchmarks/gpu): a failure
prints the gap it saw.
"""

import torch

import atorch
from atorch.auto import auto_accelerate
from tests.helpers.models import linear_dtypes

VOCAB, SEQ, BATCH, STEPS, LR = 128, 32, 8, 20, 1e-2


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


def assert_tracks(actual: list[float], reference: list[float], share: float) -> None:
    drop = reference[0] - reference[-1]
    assert drop > 1.0, f"the reference hardly trained ({reference[0]:.3f} -> {reference[-1]:.3f}): no effect to compare"
    gap = max(abs(a - r) for a, r in zip(actual, reference, strict=True))
    assert gap <= share * drop, (f"the run strays {gap:.4g} from its reference, {gap / drop:.3g} of the reference's "
                                 f"drop {drop:.3f} (allowed {share})\nrun:       {actual}\nreference: {reference}")
