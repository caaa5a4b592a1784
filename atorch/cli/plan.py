"""``atorch plan``: per-rank memory of candidate strategies for a model and world size, with no
hardware (the model is built on the meta device). Every figure is in GiB and the assumptions
behind it (bytes per parameter, activation dtype) are printed above the table."""

import sys

from atorch.cli.common import MAX_RANKS, MAX_SEQUENCES, add_model_flags, build_model, positive_int, startup_done

GIB = 2**30


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="estimate per-rank memory (GiB) of candidate strategies, with no hardware")
    add_model_flags(plan)  # required, as --world-size is: _missing reports every missing flag at once
    plan.add_argument("--world-size", type=positive_int("--world-size", MAX_RANKS), default=None)
    plan.add_argument("--memory", type=_size, default=None,
                      help="memory per device (80GiB, 40GB, bytes); default 80GiB, or the profile's with --search")
    plan.add_argument("--reserve", type=_reserve, default=None,
                      help="memory per device that training cannot use (CUDA context, communication buffers, the "
                           "allocator's fragmentation): 'fits' means within memory - reserve; default: the "
                           "profile's with --search and no --memory (h100_80gb: 6GiB), else 0")
    plan.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    plan.add_argument("--batch-size", type=positive_int("--batch-size", MAX_SEQUENCES), default=None,
                      help="global batch (sequences); leave out for model states only (weights, gradients, optimizer)")
    plan.add_argument("--seq-len", type=positive_int("--seq-len", MAX_SEQUENCES), default=2048)
    plan.add_argument("--dtype", default=None,
                      help="atorch accounting: the model's dtype (default float32); deepspeed: the 16-bit dtype (default bf16)")
    plan.add_argument("--optimizer", default="AdamW", help="a torch.optim class (AdamW, Adam, SGD, Adagrad, ...)")
    plan.add_argument("--accounting", default="atorch", choices=["atorch", "deepspeed"],
                      help="atorch: what atorch's methods hold; deepspeed: DeepSpeed's mixed-precision estimator")
    plan.add_argument("--exclude", nargs="*", default=[],
                      help=f"methods to leave out, beside those always left out ({', '.join(DEFAULT_EXCLUDED)}: not "
                           "costed on the meta device)")
    plan.add_argument("--search", action="store_true",
                      help="rank the search's layouts (data x tensor x pipeline) and methods by estimated step time "
                           "on --profile's hardware")
    plan.add_argument("--profile", default=None,
                      help="with --search: a hardware profile name (atorch/auto/search/profiles) or JSON file")
    plan.add_argument("--top", type=positive_int("--top"), default=10, help="with --search: how many layouts to print")
    plan.add_argument("--json", action="store_true",
                      help="with --search: print one JSON document (every candidate with its layout, memory terms, "
                           "step time, MFU and reason) instead of the table")
    plan.set_defaults(func=cmd_plan)


# Methods a plan always leaves out: fp8 and module_replace change nothing a meta-device probe sees
# (their kernels), so each would list every layout a second time. --exclude adds to them.
DEFAULT_EXCLUDED = ("fp8", "module_replace")



def _size(text: str) -> str:
    """An argparse type for --memory: a positive, finite size (80GiB, 40GB, bytes), kept as written."""
    import argparse
    import math

    from atorch.utils.sizes import parse_bytes

    try:
        value = float(parse_bytes(text)) if not text.strip().lower().endswith(("inf", "nan")) else math.inf
    except (ValueError, OverflowError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--memory takes a positive size such as 80GiB, 40GB or a number of bytes, "
                                         f"got {text!r}")
    return text


def _reserve(text: str) -> str:
    """An argparse type for --reserve: a size of 0 or more, kept as written."""
    import argparse
    import math

    from atorch.utils.sizes import parse_bytes

    try:
        value = float(parse_bytes(text))
    except (ValueError, OverflowError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--reserve takes a size of 0 or more such as 6GiB, got {text!r}")
    return text


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _missing(args) -> list[str]:
    """Every flag this plan needs and was not given (argparse would name one a run)."""
    missing = []
    if not (args.hf_config or args.model):
        missing.append("--hf-config FILE or --model MODULE:FUNCTION (the model)")
    if args.world_size is None:
        missing.append("--world-size N")
    if args.search and args.profile is None:
        from atorch.auto.search.profiles import profile_names

        missing.append(f"--profile NAME (known: {', '.join(profile_names())}) or the path of a profile JSON file")
    if args.search and args.batch_size is None:
        missing.append("--batch-size (the global batch, in sequences)")
    return missing


def cmd_plan(args) -> int:
    from atorch.auto.model_states import Assumptions
    from atorch.auto.search import cost
    from atorch.cli import plan_report

    missing = _missing(args)
    if missing:
        raise ValueError(f"atorch plan{' --search' if args.search else ''} needs " + ", ".join(missing))
    args.exclude = sorted({*DEFAULT_EXCLUDED, *args.exclude})
    from atorch.auto.registry import get_method

    for name in args.exclude:
        get_method(name)  # an unknown name is refused with the registered ones (it excluded nothing)
    if args.search:
        from atorch.cli.plan_search import cmd_plan_search

        return cmd_plan_search(args)
    if args.memory is None:
        args.memory = "80GiB"
    memory = plan_report.usable_memory(cost.parse_bytes(args.memory), cost.parse_bytes(args.reserve or 0))
    assumptions = Assumptions.make(args.accounting, args.dtype, args.optimizer)
    if args.batch_size is not None and args.batch_size % args.world_size:
        raise ValueError(f"--batch-size {args.batch_size} does not divide over {args.world_size} ranks")
    _progress("atorch plan: building the model on the meta device ...")
    model = build_model(args, assumptions.dtype if args.accounting == "atorch" else None)
    startup_done()
    params = sum(p.numel() for p in model.parameters())
    if args.batch_size is None:
        rows = _model_state_rows(model, args, assumptions)
        question = "model states only (give --batch-size and --seq-len to add activations)"
    else:
        rows = _candidate_rows(model, args, assumptions, memory)
        question = f"global batch {args.batch_size} x {args.seq_len} tokens"
    reserved = f" ({args.reserve} reserved: {memory / 2**30:.1f} GiB usable)" if args.reserve else ""
    print(f"{params / 1e9:.2f}B parameters, {args.world_size} x {args.device} with {args.memory} each{reserved}, "
          f"{question}")
    for line in assumptions.describe():
        print(line)
    if args.batch_size is not None:
        print(f"  activations      measured on one per-rank micro-batch ({args.batch_size // args.world_size} x "
              f"{args.seq_len}) in the model's dtype ({str(next(model.parameters()).dtype).removeprefix('torch.')}); "
              "under amp_native in autocast's dtypes (its casts emulated on meta); checkpointing keeps the block inputs")
    if args.batch_size is not None and (note := plan_report.amp_note(args.exclude)):
        print(note)
    print(f"  sharding over {args.world_size} data-parallel ranks: zero1 divides optimizer state, zero2 also "
          "gradients, fsdp also weights; DDP (plain and zero1) keeps a copy of the gradients in its buckets")
    print("all figures: GiB per rank")
    _print_table(rows, args.batch_size is not None, memory)
    return 0


def _model_state_rows(model, args, assumptions) -> list:
    from atorch.auto.model_states import model_states
    from atorch.auto.registry import method_names

    shardings = [None] + [s for s in ("zero1", "zero2", "fsdp") if s in method_names() and s not in args.exclude]
    rows = []
    for index, sharding in enumerate(shardings, 1):
        _progress(f"[{index}/{len(shardings)}] {sharding or 'ddp'}")
        states = model_states(model, sharding if args.world_size > 1 else None, args.world_size, assumptions)
        names = ["parallel_mode"] + ([sharding] if sharding else [])
        rows.append((names, {**states, "activations": None}, None))
    return rows


def _candidate_rows(model, args, assumptions, memory) -> list:
    import torch

    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import cost
    from atorch.auto.search.space import candidate_space
    from atorch.utils.memo import kept as memo_kept

    def device_ctx(device: str):
        capability = (9, 0) if device == "cuda" else None
        return DeviceContext(args.world_size, min(args.world_size, 8), torch.device(device), capability, memory)

    micro = args.batch_size // args.world_size
    batch = {"input_ids": torch.zeros(micro, args.seq_len, dtype=torch.long, device="meta")}
    batch["labels"] = batch["input_ids"]
    # Module rewrites run as on the CPU; autocast does nothing on meta tensors, so amp_native's
    # activation term counts its activations in autocast's dtype (atorch/methods/amp_native.py).
    meta_ctx = device_ctx("cpu")
    # one forward per distinct probe: candidates that differ only in sharding share theirs (72
    # candidates of a 7B plan run 18 probes instead of 120)
    memo: dict = {}

    def probe(strategy, flops):
        return cost.activation_bytes(model, strategy, batch, "unpack_dict", None, meta_ctx, flops, memo=memo)

    candidates = list(candidate_space(device_ctx(args.device), excluded=args.exclude))
    with memo_kept():  # the model's structure is read once for every candidate (atorch/utils/memo.py)
        rows = []
        for index, strategy in enumerate(candidates, 1):
            _progress(f"[{index}/{len(candidates)}] {' + '.join(strategy.opt_names) or '(plain)'}")
            rows.append(_candidate_row(model, strategy, args, assumptions, probe))
    return rows


def _candidate_row(model, strategy, args, assumptions, probe) -> tuple:
    from atorch.auto.model_states import model_states
    from atorch.auto.search.estimate import estimate_candidate
    from atorch.auto.search.space import method_labels
    from atorch.utils.log import quiet

    labels = method_labels(strategy.items())  # "checkpoint (selective)", "gradient_accumulation x4": rows differ

    with quiet():
        est, reason = estimate_candidate(model, strategy, args.world_size, assumptions.state_factor, probe, args.device)
    if est is None:
        return labels, None, reason or "no estimate: a method cannot run on the meta device"
    terms = {"params": est.params, "grads": est.grads, "optim_state": est.optim_state, "gathered": est.gathered,
             "activations": est.activations, "step_temp": est.step_temp, "backward_grads": est.backward_grads,
             "buckets": est.buckets, "reduce_temp": est.reduce_temp}
    if assumptions.accounting == "deepspeed":
        sharding = next((s for s in ("zero1", "zero2", "fsdp") if s in strategy.opt_names), None)
        terms.update(model_states(model, sharding, args.world_size, assumptions))
        if sharding is not None:  # DeepSpeed's ZeRO engine replaces DDP and its buckets
            terms["buckets"] = 0
    return labels, terms, None


def _peak(terms: dict) -> int:
    """The row's peak, by cost.MemoryEstimate.total's formula over its (possibly re-accounted) terms."""
    from atorch.auto.search.cost import MemoryEstimate

    return MemoryEstimate(**terms).total


def _print_table(rows, with_activations: bool, memory: int) -> None:
    from atorch.utils.text_table import output_width, table

    header = ["weights", "grads", "optim", "gathered", "buckets", "states"] + (["acts", "peak"] if with_activations else [])

    def order(row):
        names, terms, _ = row
        if terms is None:
            return (2, len(names), 0)
        total = _peak(terms) if with_activations else _states(terms)
        return (0 if total <= memory else 1, len(names), total)

    lines = [["strategy", *header, "verdict"]]
    for names, terms, reason in sorted(rows, key=order):
        label = " + ".join(names) or "(plain)"
        if terms is None:
            lines.append([label, *([""] * len(header)), reason])
            continue
        cells = [terms["params"], terms["grads"], terms["optim_state"], terms["gathered"], terms.get("buckets", 0),
                 _states(terms)]
        if with_activations:
            cells += [terms["activations"], _peak(terms)]
        verdict = "fits" if cells[-1] <= memory else "over budget"
        lines.append([label, *(f"{c / GIB:.2f}" for c in cells), verdict])
    # the strategy folds at its " + ", a reason under itself: every line within the terminal's width
    print("\n".join(table(lines, output_width(), wrap=(0,), right=range(1, len(header) + 1), fill=len(header) + 1,
                           fill_min=11, title=(0,))))


def _states(terms: dict) -> int:
    """The model states at their worst moment: weights, optimizer state and DDP's buckets all the
    time, and the larger of the gathered weights (forward and backward) and the gradients (the
    step), which are never alive together in the peak's formula (cost.MemoryEstimate.total), so
    the states never read above the peak (a 7B row read 88.84 GiB of states, 82.28 peak)."""
    return (terms["params"] + terms["optim_state"] + terms.get("buckets", 0)
            + max(terms["grads"], terms["gathered"]))
