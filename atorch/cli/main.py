"""``atorch``: plan, validate and explain strategies without training.

    atorch validate strategies/llama_fsdp_bf16_checkpoint.json --world-size 8
    atorch explain report.json
    atorch plan --hf-config llama7b.json --world-size 64 --memory 80GiB --batch-size 64 --seq-len 2048
"""

import argparse
import json
import sys

import torch


def _device_ctx(world_size: int, device: str, memory: int):
    from atorch.auto.environment import DeviceContext

    capability = (9, 0) if device == "cuda" else None
    return DeviceContext(world_size, min(world_size, 8), torch.device(device), capability, memory)


def cmd_validate(args) -> int:
    from atorch.auto.plan import plan_strategy
    from atorch.auto.strategy import Strategy

    strategy = Strategy.load(args.file)
    planned, notes = plan_strategy(strategy, _device_ctx(args.world_size, args.device, 2**40))
    print(f"{args.file}: valid")
    print(strategy)
    if notes:
        print(f"on {args.world_size} x {args.device}:")
        for note in notes:
            print(f"  - {note}")
        print(planned)
    return 0


def cmd_explain(args) -> int:
    from atorch.auto.search.report import SearchReport

    print(SearchReport.load(args.report).table())
    return 0


def _build_model(args) -> torch.nn.Module:
    if args.hf_config:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**json.loads(open(args.hf_config).read()))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    module_name, _, function = args.model.partition(":")
    if not function:
        raise ValueError("--model takes module:function (a function that returns the model)")
    import importlib

    with torch.device("meta"):
        return getattr(importlib.import_module(module_name), function)()


def cmd_plan(args) -> int:
    from atorch.auto.search import cost
    from atorch.auto.search.engine import estimate_candidate
    from atorch.auto.search.space import candidate_space
    from atorch.utils.log import quiet

    memory = cost.parse_bytes(args.memory)
    device_ctx = _device_ctx(args.world_size, args.device, memory)
    model = _build_model(args)
    if args.batch_size % args.world_size:
        raise ValueError(f"--batch-size {args.batch_size} does not divide over {args.world_size} ranks")
    micro = args.batch_size // args.world_size
    batch = {"input_ids": torch.zeros(micro, args.seq_len, dtype=torch.long, device="meta")}
    batch["labels"] = batch["input_ids"]
    optim_factor = cost.optimizer_state_factor(torch.optim.AdamW, {})
    rows = []
    # Module rewrites run as on the CPU (autocast leaves meta tensors in fp32, so amp's activations
    # are counted at full precision: a pessimistic figure).
    meta_ctx = _device_ctx(args.world_size, "cpu", memory)
    def probe(strategy, flops):
        return cost.activation_bytes(model, strategy, batch, "unpack_dict", None, meta_ctx, flops)

    for strategy in candidate_space(device_ctx, excluded=args.exclude):
        with quiet():
            est, reason = estimate_candidate(model, strategy, args.world_size, optim_factor, probe)
        if est is None:
            rows.append((strategy.opt_names, None, reason or "no estimate: a method cannot run on the meta device"))
            continue
        rows.append((strategy.opt_names, est, "fits" if est.total <= memory else "over budget"))
    rows.sort(key=lambda r: (r[1] is None, r[2] != "fits", len(r[0]), r[1].total if r[1] else 0))
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e9:.2f}B parameters, {args.world_size} x {args.device} with {args.memory} each, "
          f"global batch {args.batch_size} x {args.seq_len} tokens, AdamW")
    gib = 2**30
    print(f"{'strategy':58} {'params':>8} {'grads':>8} {'optim':>8} {'gather':>8} {'acts':>8} {'peak':>8}  verdict")
    for names, est, verdict in rows:
        label = " + ".join(names) or "(plain)"
        if est is None:
            print(f"{label:58} {verdict}")
            continue
        cells = [est.params, est.grads, est.optim_state, est.gathered, est.activations, est.total]
        print(f"{label:58} " + " ".join(f"{c / gib:7.1f}G" for c in cells) + f"  {verdict}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="atorch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check a strategy file (the same errors as auto_accelerate)")
    validate.add_argument("file")
    validate.add_argument("--world-size", type=int, default=1)
    validate.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    validate.set_defaults(func=cmd_validate)
    explain = sub.add_parser("explain", help="print a search report as a table")
    explain.add_argument("report")
    explain.set_defaults(func=cmd_explain)
    plan = sub.add_parser("plan", help="estimate per-rank memory of candidate strategies, with no hardware")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", help="a transformers config as JSON (with model_type)")
    source.add_argument("--model", help="module:function returning the model (built on the meta device)")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--memory", default="80GiB", help="memory per device")
    plan.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    plan.add_argument("--batch-size", type=int, required=True, help="global batch (sequences)")
    plan.add_argument("--seq-len", type=int, default=2048)
    plan.add_argument("--exclude", nargs="*", default=["fp8", "module_replace"])
    plan.set_defaults(func=cmd_plan)
    args = parser.parse_args(argv)
    from atorch.errors import AtorchConfigError

    try:
        return args.func(args)
    except (AtorchConfigError, ValueError, OSError) as error:
        print(f"atorch {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
