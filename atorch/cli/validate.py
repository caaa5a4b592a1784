"""``atorch validate FILE [--model m:f | --hf-config c.json] [--world-size N]``: every problem of a
strategy file at once, against a model when given one."""

import sys

from atorch.cli.common import MAX_RANKS, add_model_flags, build_model, positive_int


def add_parser(sub) -> None:
    validate = sub.add_parser(
        "validate", help="check a strategy file: every problem at once, against a model when given one")
    validate.add_argument("file")
    validate.add_argument("--world-size", type=positive_int("--world-size", MAX_RANKS), default=None,
                          help="also fit the file to N ranks (conflicts are refused at any world size)")
    validate.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    add_model_flags(validate)
    validate.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    from atorch.auto.validate import check_strategy_file

    check = check_strategy_file(args.file, args.world_size, args.device, build_model(args))
    print(check.summary(args.world_size, args.device), file=sys.stdout if check.ok else sys.stderr)
    return 0 if check.ok else 2
