"""Resume equivalence: 10 steps straight == 5 steps, save, new processes, load, 5 steps."""

import torch

import atorch.checkpoint as ckpt
from tests.checkpoint.jobs import build, train
from tests.helpers.dist import run_distributed

STRATEGIES = ("ddp", "fsdp", "zero1", "tp")
DROPOUT = 0.1  # the random streams must come back too


def _first_run(directory):
    out = {}
    for name in STRATEGIES:
        result = build(name, dropout=DROPOUT)
        torch.manual_seed(7)
        straight = train(result, 10)
        result = build(name, dropout=DROPOUT)
        torch.manual_seed(7)
        half = train(result, 5)
        ckpt.save(f"{directory}/{name}", result.model, result.optim, result.lr_scheduler, result.dataloader,
                  extra={"step": 5})
        out[name] = {"straight": straight, "half": half}
    return out


def _resumed_run(directory):
    out = {}
    for name in STRATEGIES:
        result = build(name, seed=3, dropout=DROPOUT)  # other weights, other random state: load replaces them
        torch.manual_seed(99)
        extra = ckpt.load(f"{directory}/{name}", result.model, result.optim, result.lr_scheduler, result.dataloader)
        out[name] = {"extra": extra, "losses": train(result, 5), "position": result.dataloader.state_dict()}
    return out


def test_resumed_run_continues_exactly_on_2_processes(tmp_path):
    first = run_distributed(_first_run, 2, str(tmp_path))
    resumed = run_distributed(_resumed_run, 2, str(tmp_path))
    for name in STRATEGIES:
        straight, half = first[0][name]["straight"], first[0][name]["half"]
        assert half == straight[:5], name
        for rank in range(2):
            got = resumed[rank][name]
            assert got["extra"] == {"step": 5}
            # 10 steps of 8 batches per epoch: the resumed run crossed into epoch 1 at the right batch.
            assert got["position"] == {"epoch": 1, "batches": 2, "global_batch_size": 8}
            assert max(abs(a - b) for a, b in zip(got["losses"], straight[5:])) <= 1e-6, (name, got["losses"], straight)
