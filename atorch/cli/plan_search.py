"""``atorch plan --search``: the search's layouts and methods, ranked by the cost model on a named
hardware profile, with no hardware.

The candidates are the search's own (``layout_space`` x ``candidate_space``: every data x tensor x
pipeline split the registry's layout methods allow, each with zero/fsdp, amp and checkpoint); each
is costed by ``cost_candidate`` (memory and step time, terms from each method's registry row) at
the profile's rates; those over the profile's memory are pruned; the rest are ranked by estimated
step time. Nothing runs: every figure is an estimate.

    atorch plan --search --profile h100_80gb --hf-config docs/plans/llama7b.json \\
        --world-size 64 --batch-size 64 --seq-len 4096
"""

import math
import sys
from collections import Counter
from contextlib import nullcontext

import torch

from atorch.cli.common import build_model

GIB = 2**30
def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def plan_search(model, world: int, global_batch: int, seq_len: int, profile, state_factor: float,
                excluded=(), memory: int | None = None) -> dict:
    """:func:`_plan_search`, computing what depends only on the model's structure once
    (:mod:`atorch.utils.memo`)."""
    from atorch.utils import memo

    with memo.kept():
        return _plan_search(model, world, global_batch, seq_len, profile, state_factor, excluded, memory)


def _plan_search(model, world: int, global_batch: int, seq_len: int, profile, state_factor: float,
                 excluded=(), memory: int | None = None) -> dict:
    """Every candidate of the search for ``model`` on ``world`` ranks of ``profile``, costed.

    Returns ``{"rows": [...], "counts": Counter, "flops_per_token": float}``; each row is a dict
    with ``strategy``, ``layout``, ``memory`` (bytes per rank), ``seconds``, ``tokens_per_s``,
    ``mfu``, ``fits``, or ``reason`` when it has no estimate. Activations are probed once per
    distinct set of probed methods on one sequence and scaled to each layout's per-data-rank batch.
    """
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import cost
    from atorch.auto.search.attention import FlashAttentionProbe
    from atorch.auto.search.engine import cost_candidate, layout_dims
    from atorch.auto.search.space import candidate_space, layout_space, layout_text
    from atorch.auto.strategy import Strategy
    from atorch.distributed.topology import data_parallel_size
    from atorch.utils.log import quiet

    memory = profile.memory if memory is None else memory
    local = min(world, profile.gpus_per_node)
    device_ctx = DeviceContext(world, local, torch.device("cuda"), (9, 0), memory)
    # Module rewrites run as on the CPU; the probe's tensors stay on meta (see atorch/cli/plan.py).
    probe_ctx = DeviceContext(world, local, torch.device("cpu"), None, memory)
    batch = {"input_ids": torch.zeros(1, seq_len, dtype=torch.long, device="meta")}
    batch["labels"] = batch["input_ids"]
    attention = FlashAttentionProbe if profile.attention == "flash" else nullcontext
    probes: dict = {}  # cost._probe's memo: one probe per distinct set of applied methods

    def probe_one(strategy) -> tuple[int, float]:
        flops: list = []
        before = len(probes)
        with attention(), quiet():
            saved = cost.activation_bytes(model, strategy, batch, "unpack_dict", None, probe_ctx, flops, memo=probes)
        if len(probes) > before:
            _progress(f"  probed activations of one sequence under: {', '.join(strategy.opt_names) or 'no method'}")
        return saved, flops[0] if flops else 0.0

    def probe(strategy, flops: list, dims: dict) -> tuple[int, int]:
        per_rank = global_batch // data_parallel_size(dims)
        saved, forward = probe_one(strategy)
        flops.append(forward * per_rank)
        return saved * per_rank, per_rank * seq_len

    _, forward = probe_one(Strategy())
    flops_per_token = 3 * forward / seq_len  # forward + backward, no recomputation: model FLOPs
    counts: Counter = Counter()
    layouts, ineligible = layout_space(model, device_ctx, global_batch, "unpack_dict", list(excluded))
    counts["ineligible layouts"] = len(ineligible)
    candidates = candidate_space(device_ctx, list(excluded), None, None, layouts, counts)
    rows = []
    for index, strategy in enumerate(candidates, 1):
        dims = layout_dims(strategy, world)
        dp = data_parallel_size(dims)
        layout = layout_text(dims.items(), _layout_config(strategy))
        row = {"strategy": strategy, "layout": layout, "names": [n for n in strategy.opt_names if n != "parallel_mode"]}
        if global_batch % dp:
            row["reason"] = f"the global batch {global_batch} does not divide over {dp} data-parallel ranks"
            rows.append(row)
            continue
        if index % 50 == 0:
            _progress(f"  [{index}/{len(candidates)}] costed")
        with quiet():
            step, reason = cost_candidate(model, strategy, dims, state_factor, probe, "cuda")
        if step is None:
            row["reason"] = reason or "no estimate (a method cannot be costed on the meta device)"
            rows.append(row)
            continue
        step.profile = profile
        seconds = step.seconds()
        tokens_per_s = global_batch * seq_len / seconds
        row.update(memory=step.memory().total, seconds=seconds, tokens_per_s=tokens_per_s,
                   mfu=flops_per_token * tokens_per_s / (world * profile.peak("half")))
        row["fits"] = row["memory"] <= memory
        rows.append(row)
    counts["costed"] = sum(1 for r in rows if "memory" in r)
    counts["over memory"] = sum(1 for r in rows if "memory" in r and not r["fits"])
    counts["no estimate"] = sum(1 for r in rows if "reason" in r)
    counts["fit"] = sum(1 for r in rows if r.get("fits"))
    return {"rows": rows, "counts": counts, "flops_per_token": flops_per_token, "memory": memory}


def _layout_config(strategy) -> dict | None:
    from atorch.auto.registry import get_method

    for name, config in strategy.items():
        if get_method(name).layouts is not None:
            return config.model_dump()
    return None


def cmd_plan_search(args) -> int:
    from atorch.auto.model_states import Assumptions
    from atorch.auto.search import cost
    from atorch.auto.search.profiles import load_profile, profile_names

    if args.profile is None:
        raise ValueError(f"atorch plan --search needs --profile NAME (known: {', '.join(profile_names())}) or the path "
                         "of a profile JSON file")
    if args.batch_size is None:
        raise ValueError("atorch plan --search needs --batch-size (the global batch, in sequences)")
    profile = load_profile(args.profile)
    memory = cost.parse_bytes(args.memory) if args.memory else profile.memory
    assumptions = Assumptions.make("atorch", args.dtype, args.optimizer)
    _progress("atorch plan --search: building the model on the meta device ...")
    model = build_model(args, assumptions.dtype)
    params = sum(p.numel() for p in model.parameters())
    result = plan_search(model, args.world_size, args.batch_size, args.seq_len, profile, assumptions.state_factor,
                         args.exclude, memory)
    _print(result, args, profile, params, assumptions)
    return 0


def _print(result, args, profile, params, assumptions) -> None:
    counts, rows, memory = result["counts"], result["rows"], result["memory"]
    nodes = math.ceil(args.world_size / profile.gpus_per_node)
    print(f"{params / 1e9:.3g}B parameters on {args.world_size} x {profile.name} ({nodes} node(s) of "
          f"{profile.gpus_per_node}, {memory / GIB:.1f} GiB each), global batch {args.batch_size} x {args.seq_len} tokens")
    print(f"ESTIMATED, nothing measured: profile {profile.name}: bf16 {profile.peak('half') / 1e12:.1f} TFLOP/s peak x "
          f"{profile.sustained_fraction:g} sustained, NVLink {profile.intra_node.bandwidth / 1e9:.0f} GB/s, "
          f"InfiniBand {profile.inter_node.bandwidth / 1e9:.0f} GB/s per GPU (sources in the profile file)")
    for line in assumptions.describe():
        print(line)
    attention = "flash attention (no seq x seq probabilities)" if profile.attention == "flash" else "SDPA's math form"
    print(f"  activations      probed on ONE sequence (1 x {args.seq_len}) on the meta device, attention as "
          f"{attention}, scaled linearly to each layout's per-data-rank batch (no gradient accumulation)")
    hidden = (f"{profile.overlap:g} of the data-parallel sync a method issues during a pass hidden behind its compute"
              if profile.overlap else "none of it overlapped")
    print(f"  time             compute / sustained rate x (1 + pipeline bubble) + communication, {hidden}; "
          f"MFU = {result['flops_per_token'] / 1e9:.1f} GFLOP/token (3 x forward) x tokens/s / "
          f"({args.world_size} x bf16 peak)")
    print("candidates: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    fitting = sorted((r for r in rows if r.get("fits")), key=lambda r: (r["seconds"], r["memory"]))
    header = f"{'rank':>4}  {'layout':50} {'methods':52} {'GiB/rank':>8} {'step s':>8} {'tokens/s':>10} {'MFU':>6}"
    if not fitting:
        costed = sorted((r for r in rows if "memory" in r), key=lambda r: r["memory"])
        print(f"nothing fits {memory / GIB:.1f} GiB per rank" + (
            f"; the smallest is {costed[0]['layout']} with {' + '.join(costed[0]['names']) or 'no method'} at "
            f"{costed[0]['memory'] / GIB:.1f} GiB: more ranks or a smaller batch would lower it" if costed else ""))
        return
    print(f"top {min(args.top, len(fitting))} of {len(fitting)} layouts that fit, fastest first (estimated):")
    print(header)
    for rank, row in enumerate(fitting[: args.top], 1):
        print(f"{rank:>4}  {row['layout']:50} {' + '.join(row['names']) or '(plain)':52} {row['memory'] / GIB:8.2f} "
              f"{row['seconds']:8.4g} {row['tokens_per_s']:10.0f} {row['mfu']:6.1%}")
