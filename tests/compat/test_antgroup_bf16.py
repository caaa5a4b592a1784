"""ATorch code on 2 gloo ranks against one process running the same recipe: its save_load test
(load_strategy=pickle.dumps(atorch's own Strategy), save_strategy_to_file), bf16 amp with
ATorch's BF16GradScaler, and ("half", "bf16") with the BF16Optimizer's fp32 master weights.

The one-process references do the ranks' bf16 arithmetic: each rank's rows (the sampler deals
every other sample), each rank's gradient halved and the two summed in the gradient's dtype, as
DDP does; so the runs agree to fp32 rounding, far below what bf16 changes."""

import pickle

import torch

from atorch.auto.strategy import Strategy
from atorch.compat import antgroup as atorch
from tests.compat.test_antgroup import GLOBAL_BATCH, LR, STEPS, Net, Rows, _loss, _serial, _train
from tests.helpers.dist import run_distributed

DATA2 = ("parallel_mode", ([("data", 2)], None), False)


def _ddp_grads(params: list, forward, batch: dict) -> list:
    grads = None
    for rank in range(2):
        rows = {key: value[rank::2] for key, value in batch.items()}
        mine = [g / 2 for g in torch.autograd.grad(_loss(rows, forward(rows["x"])), params)]
        grads = mine if grads is None else [a + b for a, b in zip(grads, mine)]
    return grads


def _bf16_serial(recipe: str) -> tuple[list, list]:
    """The weights after STEPS SGD steps, and the fp32 masters: "amp" (fp32 weights, the forward
    under bf16 autocast), "half" (a bf16 model, SGD on fp32 masters), "half_plain" (SGD on the
    bf16 weights themselves), "fp32"."""
    torch.manual_seed(0)
    model, data = Net(), Rows()
    if recipe.startswith("half"):
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "amp"):
            return model(x.to(params[0].dtype))

    for step in range(STEPS):
        batch = data[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        grads = _ddp_grads(params, forward, batch)
        with torch.no_grad():
            for param, master, grad in zip(params, masters, grads):
                if recipe == "half":
                    master -= LR * grad.float()
                    param.copy_(master)
                else:
                    param -= LR * grad
    return [p.detach().clone() for p in params], masters


def _runs(saved: str) -> dict:
    atorch.init_distributed("gloo")
    # ATorch's save_load: its own Strategy pickled, data=8 rescaled to the 2 ranks
    pickled = pickle.dumps(Strategy([("parallel_mode", ([("data", 8)], None), False)]))
    out = {"pickled": _train(pickled, save_strategy_to_file=saved)}
    out["saved"] = atorch.get_strategy(saved)
    out["amp"] = _train([DATA2, ("amp_native", {"dtype": torch.bfloat16, "skip_if_nonfinite": True}, False)])
    out["half"] = _train([DATA2, ("half", "bf16", False)])
    return out


def _rel(got, want) -> float:
    got, want = (torch.cat([t.float().flatten() for t in ts]) for ts in (got, want))
    return ((got - want).norm() / want.norm()).item()


def test_atorch_pickle_and_bf16_recipes_on_2_ranks_match_one_process(tmp_path):
    _, fp32 = _serial()
    amp, _ = _bf16_serial("amp")
    half, masters = _bf16_serial("half")
    half_plain, _ = _bf16_serial("half_plain")
    # controls: what bf16 changes (1.2e-3 here), what master weights change (3.7e-3)
    assert _rel(amp, fp32.values()) > 1e-4 and _rel(half, half_plain) > 1e-4
    for rank, out in enumerate(run_distributed(_runs, 2, str(tmp_path / "best.st"))):
        run = out["pickled"]
        assert run["strategy"] == ["parallel_mode"] and run["best"].get("parallel_mode").dims == [("data", 2)]
        assert out["saved"] == (True, run["best"])  # save_strategy_to_file read back equal
        assert _rel(run["weights"].values(), fp32.values()) <= 1e-5, rank
        assert out["amp"]["optim"] == "AmpOptimizerView" and out["half"]["optim"] == "BF16Optimizer"
        assert _rel(out["amp"]["weights"].values(), amp) <= 1e-5, rank
        assert _rel(out["half"]["masters"], masters) <= 1e-5 and _rel(out["half"]["weights"].values(), half) <= 1e-5
