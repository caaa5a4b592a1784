"""``atorch plan --search``: the search's layouts and methods, ranked by the cost model on a named
hardware profile, with no hardware.

The candidates are the search's own (``layout_space`` x ``candidate_space``: every data x tensor x
pipeline split the registry's layout methods allow, each with zero/fsdp, amp and checkpoint); each
is costed by ``cost_candidate`` (memory and step time, terms from each method's registry row) at
the profile's rates; one over the profile's memory is tried again with gradient accumulation, or a
pipeline with more microbatches (:func:`memory_retries`), and those that still do not fit are
pruned; the rest are ranked by estimated step time. Nothing runs: every figure is an estimate.

    atorch plan --search --profile h100_80gb --hf-config docs/plans/llama7b.json \\
        --world-size 64 --batch-size 64 --seq-len 4096
"""

import math
import sys
from collections import Counter
from contextlib import nullcontext

import torch

from atorch.cli.common import build_model, startup_done

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
    from atorch.auto.search.estimate import layout_dims
    from atorch.auto.search.space import candidate_space, layout_space
    from atorch.auto.strategy import Strategy
    from atorch.distributed.topology import data_parallel_size

    memory = profile.memory - profile.reserve if memory is None else memory  # usable: less the reserve
    local = min(world, profile.gpus_per_node)
    device_ctx = DeviceContext(world, local, torch.device("cuda"), (9, 0), memory)
    # Module rewrites run as on the CPU; the probe's tensors stay on meta (see atorch/cli/plan.py).
    probe = _MetaProbe(model, seq_len, global_batch, DeviceContext(world, local, torch.device("cpu"), None, memory),
                       profile.attention == "flash")
    _, (forward, *_) = probe.one(Strategy())
    flops_per_token = 3 * forward / seq_len  # forward + backward, no recomputation: model FLOPs
    counts: Counter = Counter()
    layouts, ineligible = layout_space(model, device_ctx, global_batch, "unpack_dict", list(excluded))
    counts["ineligible layouts"] = len(ineligible)
    # Accumulation comes from the memory retries below (the fewest micro-batches that fit), not
    # from the space's gradient_accumulation combinations, which would cost the same thing twice.
    candidates = candidate_space(device_ctx, [*excluded, "gradient_accumulation"], None, None, layouts, counts,
                                 model=model, global_batch=global_batch)

    def costed(row: dict, tried, dims: dict, steps: int) -> dict:
        return _costed(row, model, tried, dims, steps, state_factor, probe.for_accumulation(steps), profile,
                       global_batch, seq_len, flops_per_token, world, memory)

    rows: list = []
    fitted: dict = {}  # (strategy, accumulation) costed -> (fits or has no estimate, estimated seconds)
    for index, strategy in enumerate(candidates, 1):
        dims = layout_dims(strategy, world)
        dp = data_parallel_size(dims)
        if global_batch % dp:
            row = _row_of(strategy, dims, dp, global_batch)
            row["reason"] = f"the global batch {global_batch} does not divide over {dp} data-parallel ranks"
            rows.append(row)
            continue
        if index % 50 == 0:
            _progress(f"  [{index}/{len(candidates)}] costed")
        _cost_retries(strategy, dims, dp, global_batch, costed, fitted, rows)
    if profile.offloads() and not any(r.get("fits") for r in rows):
        _offload_pass(candidates, world, global_batch, costed, fitted, rows, counts)
    counts["costed"] = sum(1 for r in rows if "memory" in r)
    counts["over memory"] = sum(1 for r in rows if "memory" in r and not r["fits"])
    counts["no estimate"] = sum(1 for r in rows if "reason" in r)
    counts["fit"] = sum(1 for r in rows if r.get("fits"))
    return {"rows": rows, "counts": counts, "flops_per_token": flops_per_token, "memory": memory,
            "ineligible": [(layout.text, why) for layout, why in ineligible]}


def _offload_pass(candidates, world: int, global_batch: int, costed, fitted: dict, rows: list, counts) -> None:
    """Where nothing fits, each fsdp candidate again with its shards, their gradients and the
    optimizer state in host memory (FSDP2's CPUOffloadPolicy, ``("fsdp", {"cpu_offload": True})``;
    torch's AdamW steps them on the CPU): slower (every gather copies the shards in over PCIe, the
    step runs on the host), so tried only when no candidate fits without it."""
    from atorch.auto.search.estimate import layout_dims
    from atorch.auto.strategy import Strategy
    from atorch.distributed.topology import data_parallel_size

    for strategy in candidates:
        config = dict(strategy.items()).get("fsdp")
        dims = layout_dims(strategy, world)
        dp = data_parallel_size(dims)
        if config is None or config.cpu_offload or global_batch % dp:
            continue
        offloaded = Strategy([(n, c.model_copy(update={"cpu_offload": True}) if n == "fsdp" else c)
                              for n, c in strategy.items()])
        counts["offloaded"] += 1
        _cost_retries(offloaded, dims, dp, global_batch, costed, fitted, rows)


class _MetaProbe:
    """Activations of one sequence on meta tensors, probed once per distinct set of applied
    methods (cost._probe's memo) and scaled to a layout's per-data-rank batch."""

    def __init__(self, model, seq_len: int, global_batch: int, probe_ctx, flash: bool):
        from atorch.auto.search.attention import FlashAttentionProbe

        self.model, self.seq_len, self.global_batch, self.probe_ctx = model, seq_len, global_batch, probe_ctx
        self.attention = FlashAttentionProbe if flash else nullcontext
        self.batch = {"input_ids": torch.zeros(1, seq_len, dtype=torch.long, device="meta")}
        self.batch["labels"] = self.batch["input_ids"]
        self.memo: dict = {}

    def one(self, strategy) -> tuple[int, list]:
        from atorch.auto.search import cost
        from atorch.utils.log import quiet

        counted: list = []
        before = len(self.memo)
        with self.attention(), quiet():
            saved = cost.activation_bytes(self.model, strategy, self.batch, "unpack_dict", None, self.probe_ctx,
                                          counted, memo=self.memo)
        if len(self.memo) > before:
            _progress(f"  probed activations of one sequence under: {', '.join(strategy.opt_names) or 'no method'}")
        return saved, counted

    def for_accumulation(self, accumulation: int):
        """``cost_candidate``'s probe for a step of ``accumulation`` micro-batches."""
        from atorch.auto.search import cost
        from atorch.distributed.topology import data_parallel_size

        def probe(strategy, counts: list, dims: dict) -> tuple[int, int]:
            per_rank = self.global_batch // data_parallel_size(dims)
            saved, counted = self.one(strategy)
            # the step's sequences; StepCost repeats the per-step counts once per micro-batch
            counts.extend(cost.scaled_counts(counted, per_rank))
            return saved * (per_rank // accumulation), per_rank * self.seq_len  # one micro-batch's activations
        return probe


def _row_of(strategy, dims: dict, dp: int, global_batch: int) -> dict:
    from atorch.auto.search.estimate import layout_config
    from atorch.auto.search.space import layout_text, method_labels

    config = layout_config(strategy) or {}
    return {"strategy": strategy, "layout": layout_text(dims.items(), config),
            "names": [n for n in method_labels(strategy.items()) if n != "parallel_mode"],
            "dims": {"data": dp, "tensor": dims.get("tensor", 1), "pipeline": dims.get("pipeline", 1),
                     "microbatches": config.get("num_microbatches", 1),
                     "virtual_stages": config.get("virtual_pipeline_size") or 1, "accumulation": 1},
            "per_rank_batch": global_batch // dp}


def _cost_retries(strategy, dims: dict, dp: int, global_batch: int, costed, fitted: dict, rows: list) -> None:
    """``strategy`` costed with the fewest micro-batches that fit (memory_retries), each retry a
    row; a pipeline that fits tries more microbatches while its step gets faster (the bubble)."""
    retries = memory_retries(strategy, global_batch // dp)
    pipelined = any(steps == 1 and tried != strategy for tried, steps in retries)
    faster = None
    for tried, steps in retries:
        key = (repr(tried), steps)  # a pipeline's retry with 2p microbatches is also a layout of its own
        if key not in fitted:
            row = _row_of(tried, dims, dp, global_batch)
            accumulated = [f"gradient_accumulation x{steps}"] if steps > 1 else []  # the method that applies it
            row = costed(dict(row, dims=dict(row["dims"], accumulation=steps), names=row["names"] + accumulated),
                         tried, dims, steps)
            rows.append(row)
            fitted[key] = (row.get("fits") is not False, row.get("seconds"))
        fits, seconds = fitted[key]
        if fits and (not pipelined or seconds is None or (faster is not None and seconds >= faster)):
            break  # fits, or no estimate: no more micro-batches to try
        if fits:
            faster = seconds


def accumulation_choices(strategy, per_rank: int) -> list[int]:
    """Gradient accumulation steps to try, fewest first: every number that divides the per-rank
    batch (micro-batches of whole sequences, all alike; 1 is no accumulation), where the
    strategy's runtime accumulates (auto_accelerate's gradient_accumulation_steps: not under a
    pipeline, which accumulates over its own microbatches, nor DeepSpeed's engine, which runs its
    own step). Not only powers of 2: a per-rank batch of 6 sequences that needs more than 2
    micro-batches fits with 3, where 4 does not divide it."""
    from atorch.auto.registry import get_method

    if any("pipeline" in get_method(n).uses_dims for n in strategy.opt_names) \
            or any(getattr(c, "use_ds_zero", False) for _, c in strategy.items()):  # ds_3d_parallel uses pipeline
        return [1]
    return _divisors(per_rank)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first, found up to its square root ([1] for n < 1)."""
    small = [d for d in range(1, math.isqrt(max(n, 1)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small])) if n >= 1 else [1]


def memory_retries(strategy, per_rank: int) -> list:
    """``(strategy, accumulation steps)`` to try in turn until one fits: the strategy with each of
    :func:`accumulation_choices` (with fsdp, each also with its gradients reduced every
    micro-batch, after the default); for a pipeline layout (pipeline_parallel, mixed_parallel), whose
    microbatches are its accumulation, the strategy with its ``num_microbatches`` doubled while
    they divide the per-rank batch (each microbatch smaller, the bubble too: NeMo's 70B runs
    microbatches of one sequence, where the layouts' p and 2p microbatches hold 4-8 sequences a
    microbatch on 512 ranks and never fit). Doubling keeps interleaved 1F1B's rounds whole. A
    pipeline that fits goes on while its estimated step gets faster (a smaller bubble)."""
    from atorch.auto.registry import get_method
    from atorch.auto.strategy import Strategy

    for name, config in strategy.items():
        if get_method(name).layouts is not None and "num_microbatches" in type(config).model_fields:
            tried, microbatches = [], config.num_microbatches
            while microbatches <= per_rank and per_rank % microbatches == 0:
                changed = config.model_copy(update={"num_microbatches": microbatches})
                tried.append((Strategy([(n, changed if n == name else c) for n, c in strategy.items()]), 1))
                microbatches *= 2
            return tried or [(strategy, 1)]
    retries = []
    for steps in accumulation_choices(strategy, per_rank):
        retries.append((strategy, steps))
        if steps > 1 and _keeps_whole_gradients(strategy):
            retries.append((_reducing_every_micro_batch(strategy), steps))
    return retries


def _keeps_whole_gradients(strategy) -> bool:
    """fsdp as it runs by default under accumulation: whole gradients until the last micro-batch."""
    config = dict(strategy.items()).get("fsdp")
    return config is not None and not config.reduce_every_micro_batch


def _reducing_every_micro_batch(strategy):
    """``strategy`` with fsdp reducing its gradients after every micro-batch (less memory, more
    traffic: tried after the default at the same accumulation, before more micro-batches)."""
    from atorch.auto.strategy import Strategy

    return Strategy([(n, c.model_copy(update={"reduce_every_micro_batch": True}) if n == "fsdp" else c)
                     for n, c in strategy.items()])


def _costed(row: dict, model, strategy, dims, steps, state_factor, probe, profile, global_batch, seq_len,
            flops_per_token, world, memory) -> dict:
    """``row`` with the candidate's estimate at ``steps`` accumulation steps (or why it has none)."""
    from atorch.auto.search.estimate import cost_candidate
    from atorch.utils.log import quiet

    if steps > 1:
        row["layout"] += f", accumulation={steps}"
    with quiet():
        step, reason = cost_candidate(model, strategy, dims, state_factor, probe, "cuda", accumulation=steps)
    if step is None:
        row["reason"] = reason or "no estimate (a method cannot be costed on the meta device)"
        return row
    step.profile = profile
    seconds = step.seconds()
    tokens_per_s = global_batch * seq_len / seconds
    estimate = step.memory()
    row.update(memory=estimate.total, terms=estimate.as_dict(), seconds=seconds, tokens_per_s=tokens_per_s,
               mfu=flops_per_token * tokens_per_s / (world * profile.peak("half")), fits=estimate.total <= memory)
    return row


def cmd_plan_search(args) -> int:
    import json

    from atorch.auto.model_states import Assumptions
    from atorch.auto.search import cost
    from atorch.auto.search.profiles import load_profile
    from atorch.cli import plan_report

    profile = load_profile(args.profile)  # the flags it needs were checked by atorch.cli.plan
    capacity = cost.parse_bytes(args.memory) if args.memory else profile.memory
    # the profile's reserve goes with the profile's memory; a --memory given is planned within as it is
    reserve = (cost.parse_bytes(args.reserve) if args.reserve is not None
               else 0 if args.memory else profile.reserve)
    memory = plan_report.usable_memory(capacity, reserve)  # what "fits" means
    assumptions = Assumptions.make("atorch", args.dtype, args.optimizer)
    _progress("atorch plan --search: building the model on the meta device ...")
    model = build_model(args, assumptions.dtype)
    startup_done()
    params = sum(p.numel() for p in model.parameters())
    result = plan_search(model, args.world_size, args.batch_size, args.seq_len, profile, assumptions.state_factor,
                         args.exclude, memory)
    records = plan_report.records(result, args.world_size)
    if getattr(args, "json", False):
        header = {"estimated": True, "profile": profile.name, "parameters": params, "world_size": args.world_size,
                  "global_batch": args.batch_size, "seq_len": args.seq_len, "memory_bytes": capacity,
                  "reserve_bytes": reserve, "usable_bytes": memory}
        if note := plan_report.amp_note(args.exclude):
            header["notes"] = [" ".join(note.split())]
        print(json.dumps(plan_report.document(result, records, header), indent=1))
        return 0
    _print(result, records, args, profile, params, assumptions, reserve)
    return 0


def _print(result, records, args, profile, params, assumptions, reserve: int) -> None:
    from atorch.cli import plan_report

    counts, memory = result["counts"], result["memory"]
    nodes = math.ceil(args.world_size / profile.gpus_per_node)
    print(f"{params / 1e9:.3g}B parameters on {args.world_size} x {profile.name} ({nodes} node(s) of "
          f"{profile.gpus_per_node}, {(memory + reserve) / GIB:.1f} GiB each, {reserve / GIB:.1f} reserved: "
          f"{memory / GIB:.1f} GiB usable), global batch {args.batch_size} x {args.seq_len} tokens")
    print(f"ESTIMATED, nothing measured: profile {profile.name}: bf16 {profile.peak('half') / 1e12:.1f} TFLOP/s peak x "
          f"{profile.sustained_fraction:g} sustained, NVLink {profile.intra_node.bandwidth / 1e9:.0f} GB/s, "
          f"InfiniBand {profile.inter_node.bandwidth / 1e9:.0f} GB/s per GPU (sources in the profile file)")
    for line in assumptions.describe():
        print(line)
    attention = "flash attention (no seq x seq probabilities)" if profile.attention == "flash" else "SDPA's math form"
    print(f"  activations      probed on ONE sequence (1 x {args.seq_len}) on the meta device, attention as "
          f"{attention}, scaled linearly to each layout's micro-batch; a candidate over memory is tried again with "
          "gradient accumulation (2, 4, ... micro-batches a step), a pipeline with its microbatches doubled, until "
          "it fits")
    if note := plan_report.amp_note(args.exclude):
        print(note)
    hidden = (f"{profile.overlap:g} of the data-parallel sync a method issues during a pass hidden behind its compute"
              if profile.overlap else "none of it overlapped")
    print(f"  time             compute / sustained rate x (1 + pipeline bubble) + communication, {hidden}; "
          f"MFU = {result['flops_per_token'] / 1e9:.1f} GFLOP/token (3 x forward) x tokens/s / "
          f"({args.world_size} x bf16 peak)")
    print("candidates: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    reasons = list(dict.fromkeys(why for _, why in result["ineligible"]))  # one line per distinct reason
    for why in reasons[:3]:
        print(f"  ineligible: {why}")
    if len(reasons) > 3:
        print(f"  ... and {len(reasons) - 3} more reasons layouts are ineligible (--json lists every layout with why)")
    fitting = [r for r in records if r["fits"]]
    if not fitting:
        print(plan_report.nothing_fits(records, memory))
        return
    print(f"top {min(args.top, len(fitting))} of {len(fitting)} layouts that fit, fastest first (estimated):")
    print("\n".join(_top_table(fitting[: args.top])))
    over = [r for r in records if r["fits"] is False]
    if over:
        print(f"closest over memory: {over[0]['layout_text']} with {' + '.join(over[0]['methods']) or 'no method'}: "
              f"{over[0]['reason']}")


def _top_table(records: list[dict]) -> list[str]:
    """The fastest plans as a table within the terminal's width: layouts fold at their " x " and
    ", ", methods at their " + "; a terminal too narrow for the columns gets a block per plan."""
    from atorch.utils.text_table import output_width, table

    rows = [["rank", "layout", "methods", "GiB/rank", "step s", "tok/s/GPU", "MFU"]]
    for rank, record in enumerate(records, 1):
        rows.append([str(rank), record["layout_text"], " + ".join(record["methods"]) or "(plain)",
                     f"{record['memory_bytes']['total'] / GIB:.2f}", f"{record['step_seconds']:.4g}",
                     f"{record['tokens_per_second_per_device']:.0f}", f"{record['mfu']:.1%}"])
    return table(rows, output_width(), wrap=(1, 2), right=(0, 3, 4, 5, 6), title=(0, 1, 2))

