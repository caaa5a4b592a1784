"""The methods' host overheads, calibrated: what a training step under each method takes on this
machine beyond what the rest of the step-time estimate counts (operators, FLOPs, collectives).

On a CPU, or with a model small for its device, a step is mostly framework overhead: DDP's reducer
and hooks, a sharding wrapper's hooks, a pipeline schedule's Python per microbatch, a tensor
layer's autograd function per collective, the loader and the optimizer's loop over parameters. On
search_quality's small Llama (4 gloo ranks on 2 cores) plain DDP measured 1.9x its estimate,
tensor=2 x data=2 3.9x, and the estimate ranked the candidates at Spearman 0.6-0.8.

Calibration dry-runs a few candidates of the search's own space on a small Llama (transformers'
``LlamaForCausalLM``, 4 blocks of hidden 64 on 32 tokens, 2 samples a rank): plain data parallel,
zero1, zero2, fsdp, checkpointing, amp and gradient accumulation (2 micro-batches) over every
rank, tensor=2, pipeline=2 with 2 and 4 microbatches, and pipeline=4 with 4 where the world has 4
ranks a data rank. Each gives one equation: measured step - estimated step (at the rates just measured,
without these overheads) = the sum over the methods of the units its estimate charges
(``StepCost.overhead_units``: "step" once for every candidate, DDP once a step, a tensor layer
per collective it launches, a pipeline per stage-microbatch a rank runs, a checkpoint per tensor its hooks pack, a sharding
wrapper per collective its hooks issue, autocast per forward operator, gradient accumulation per
micro-batch past the first) x that method's seconds per unit. The seconds are the
non-negative least-squares solution. Without transformers nothing is measured (no overheads).

    >>> fit_seconds([({"step": 1.0}, 0.02), ({"step": 1.0, "zero1": 1.0}, 0.05)])
    {'step': 0.02, 'zero1': 0.03}
"""

import statistics

import torch

from atorch.auto.search.agree import from_rank0
from atorch.utils.log import logger, quiet

# the calibration Llama: hidden, blocks, heads, vocabulary, tokens a sample; samples a rank
LLAMA = {"hidden": 64, "layers": 4, "heads": 4, "vocab": 256, "seq": 32}
SAMPLES_PER_RANK = 2
TIMED_STEPS = 7
# Each candidate is dry-run once a round, and each round fit on its own; a method's seconds are
# the median of the rounds' (a round the shared machine disturbed is outvoted). One reading put
# amp's overhead at 4x another's; two rounds fit together put checkpointing's at 6.8e-5 s a saved
# tensor in one calibration and 7.9e-6 in the next, and search_quality's pipeline-best ranked at
# Spearman 0.89, then 0.77
ROUNDS = 3


def wanted(world: int) -> list[tuple[tuple[str, ...], str]]:
    """The candidates calibration dry-runs, as (methods besides the layout's, layout)."""
    if world < 2:
        return [((), "1 rank"), (("checkpoint",), "1 rank"), (("amp_native",), "1 rank"),
                (("gradient_accumulation",), "1 rank")]
    data = f"data={world}"
    half = "" if world == 2 else f" x data={world // 2}"
    return [((), data), (("zero1",), data), (("zero2",), data), (("fsdp",), data), (("checkpoint",), data),
            (("amp_native",), data), (("gradient_accumulation",), data), (("tensor_parallel",), f"tensor=2{half}"),
            (("pipeline_parallel",), f"pipeline=2{half}, microbatches=2"),
            (("pipeline_parallel",), f"pipeline=2{half}, microbatches=4")] + _deep_pipeline(world)


def _deep_pipeline(world: int) -> list[tuple[tuple[str, ...], str]]:
    """pipeline=4 too, where the world has 4 ranks a data rank: a stage-microbatch of pipeline=2
    alone put the unit at 10 ms on search_quality's 4 ranks on 2 cores, where pipeline=4's steps
    left about 1-9 ms a unit beyond the rest of their estimate (pipeline-best: Spearman 0.77, 0.84
    with the pipeline's overhead left out)."""
    if world % 4:
        return []
    rest = "" if world == 4 else f" x data={world // 4}"
    return [(("pipeline_parallel",), f"pipeline=4{rest}, microbatches=4")]


def _job():
    """(model, dataset, loss_func) of the calibration Llama, or None without transformers."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    size = LLAMA
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=int(2.75 * size["hidden"]),
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"] // 2, max_position_embeddings=size["seq"], attn_implementation="sdpa"))
    tokens = torch.randint(0, size["vocab"], (256, size["seq"]), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    return model, dataset, lambda batch, output: output.loss


def candidates(model, device_ctx, global_batch: int) -> list:
    """The :func:`wanted` strategies out of the search's own space for ``model``, in that order."""
    from atorch.auto.search.estimate import layout_config, layout_dims, resolved
    from atorch.auto.search.space import candidate_space, layout_space, layout_text

    world = device_ctx.world_size
    layouts, _ = layout_space(model, device_ctx, global_batch, "unpack_dict", None, None)
    found: dict = {}
    for strategy in candidate_space(device_ctx, None, None, None, layouts, model=model, global_batch=global_batch):
        strategy = resolved(model, strategy)
        names = tuple(n for n in strategy.opt_names if n not in ("parallel_mode", "tensor_parallel", "pipeline_parallel"))
        layout = layout_text(layout_dims(strategy, world).items(), layout_config(strategy))
        split = tuple(n for n in strategy.opt_names if n in ("tensor_parallel", "pipeline_parallel"))
        found.setdefault((names or split, layout), strategy)
    return [found[key] for key in wanted(world) if key in found]


def measure_method_seconds(data: dict) -> tuple[dict, str]:
    """{method: host seconds per unit} on this machine, and how it was measured (a profile's
    source line); every rank calls it. ``data``: the rates just measured (a profile's data)."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import measure
    from atorch.auto.search.profiles import profile_from_data

    job = _job()
    if job is None:
        return {}, "not measured: the calibration model is a transformers Llama (pip install transformers)"
    model, dataset, loss_func = job
    device_ctx = DeviceContext.detect()
    global_batch = SAMPLES_PER_RANK * device_ctx.world_size
    chosen = candidates(model, device_ctx, global_batch)
    profile = profile_from_data({**data, "method_seconds": {}}, "calibration")
    fits = []
    for _ in range(ROUNDS):
        with quiet():
            report = measure(model, chosen, torch.optim.AdamW, dataset, loss_func, profile=profile,
                             timed_steps=TIMED_STEPS, max_dryruns=len(chosen), optim_args={"lr": 1e-3},
                             dataloader_args={"batch_size": global_batch, "shuffle": False},
                             model_input_format="unpack_dict")
        fits.append(fit_seconds([(c.estimate_overheads or {}, global_batch / c.throughput - c.estimated_step_seconds)
                                 for c in report.candidates if c.throughput and c.estimated_step_seconds]))
        failed = [" + ".join(c.names) for c in report.candidates if not c.throughput]
        if failed:
            logger.warning("calibration: %s did not run (%s); their overheads are not measured", failed,
                           "; ".join(str(c.reason) for c in report.candidates if not c.throughput))
    seconds = from_rank0(median_fit(fits))
    size = ", ".join(f"{k} {v}" for k, v in LLAMA.items())
    how = (f"{ROUNDS} rounds of dry runs ({TIMED_STEPS} timed steps) of {len(chosen)} candidates of the search's "
           f"space on a Llama ({size}; {SAMPLES_PER_RANK} samples a rank): measured step - estimated step without "
           "these overheads, fit as units charged x seconds per unit (non-negative least squares) each round, "
           "the median of the rounds' seconds")
    return seconds, how


def median_fit(fits: list[dict]) -> dict:
    """Each method's median over ``fits`` (a fit that left a method out, its fit negative, counts
    0); methods at 0 in the median are left out.

    >>> median_fit([{"step": 0.01, "zero1": 0.002}, {"step": 0.03}, {"step": 0.012, "zero1": 0.004}])
    {'step': 0.012, 'zero1': 0.002}
    """
    names = sorted({name for fit in fits for name in fit})
    out = {name: statistics.median(fit.get(name, 0.0) for fit in fits) for name in names}
    return {name: value for name, value in out.items() if value > 0}


def fit_seconds(rows: list[tuple[dict, float]]) -> dict:
    """Non-negative least squares of ``residual = sum(units[m] x seconds[m])`` over ``rows`` of
    (units by method, residual seconds): a method whose best fit is negative (its estimate was
    high already) gets 0 and the others are fit again without it."""
    names = sorted({name for units, _ in rows for name, n in units.items() if n})
    while names:
        a = torch.tensor([[units.get(name, 0.0) for name in names] for units, _ in rows], dtype=torch.float64)
        b = torch.tensor([[residual] for _, residual in rows], dtype=torch.float64)
        x = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
        if min(x) >= 0:
            return {name: round(value, 9) for name, value in zip(names, x)}
        names.pop(x.index(min(x)))
    return {}
