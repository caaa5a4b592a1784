"""``atorch``: plan, validate and explain strategies without training.

    atorch validate strategies/fsdp_bf16_checkpoint.json --hf-config gpt2.json --world-size 8
    atorch explain report.json
    atorch plan --hf-config llama7b.json --world-size 8 --dtype bf16 --accounting deepspeed
    atorch plan --hf-config llama7b.json --world-size 64 --memory 80GiB --batch-size 64 --seq-len 2048
    atorch calibrate --nproc 2
"""

import argparse
import sys

from atorch.cli import calibrate, explain, plan, validate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="atorch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    validate.add_parser(sub)
    explain.add_parser(sub)
    plan.add_parser(sub)
    calibrate.add_parser(sub)
    args = parser.parse_args(argv)
    from contextlib import nullcontext

    from atorch.cli.common import collector_off_for_startup, folded_stdout
    from atorch.errors import AtorchConfigError
    from atorch.utils.text_table import output_width

    # every line within the terminal's width ($COLUMNS, at most 120); JSON as it is
    folding = nullcontext() if getattr(args, "json", False) else folded_stdout(output_width())
    try:
        with collector_off_for_startup(), folding:
            return args.func(args)
    except (AtorchConfigError, ValueError, OSError) as error:
        print(f"atorch {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
