"""``atorch explain FILE``: a search report as a table with each candidate's memory estimate, or a
strategy file method by method."""

import json


def add_parser(sub) -> None:
    explain = sub.add_parser("explain", help="print a search report (table + memory estimates) or explain a strategy file")
    explain.add_argument("file", help="a search report (report_file=...) or a strategy file")
    explain.add_argument("--all", action="store_true", help="a search report's every candidate, pruned ones "
                         "included, each with its reason (default: the dry-run ones, the pruned grouped by rule)")
    explain.add_argument("--plot", metavar="IMAGE", help="also draw a search report's estimates against its "
                         "measurements into IMAGE (.png, .svg, .pdf)")
    explain.set_defaults(func=cmd_explain)


def _is_strategy(data) -> bool:
    if isinstance(data, list):
        return True  # a bare list of methods
    return isinstance(data, dict) and "candidates" not in data and (
        data.get("format") == "atorch-strategy" or "methods" in data)


def explain_strategy(path: str) -> str:
    """What each method of a strategy file does, in the order it is applied."""
    from atorch.auto.plan import in_applied_order
    from atorch.auto.registry import get_method
    from atorch.auto.strategy import Strategy

    strategy = Strategy.load(path)
    lines = [f"{path}: a strategy file ({len(strategy)} methods)"]
    if strategy.description:
        lines.append(f"  {strategy.description}")
    lines.append("applied in this order (whatever the order in the file):")
    for index, (name, config) in enumerate(in_applied_order(strategy), 1):
        lines.append(f"  {index}. {name}: {get_method(name).description}")
        lines.append(f"     {config.summary()}  (fields not shown: defaults, see docs/methods/{name}.md)")
    lines.append(f"check it against your model and world size: atorch validate {path} --hf-config CONFIG --world-size N")
    return "\n".join(lines)


def cmd_explain(args) -> int:
    from atorch.auto.search.report import SearchReport
    from atorch.auto.strategy import read_strategy_file

    if args.file.endswith((".yaml", ".yml")):
        data = read_strategy_file(args.file)
    else:
        try:
            with open(args.file) as file:
                data = json.load(file)
        except ValueError as error:
            raise ValueError(f"{args.file} is not JSON ({error}); explain reads search reports and strategy files") from None
    if _is_strategy(data):
        if getattr(args, "plot", None):
            raise ValueError(f"{args.file} is a strategy file; --plot draws search reports (report_file=...)")
        print(explain_strategy(args.file))
        return 0
    report = SearchReport.load(args.file)
    print(report.table(all_rows=getattr(args, "all", False)))
    print()
    print(report.breakdown())
    if getattr(args, "plot", None):
        from atorch.cli.plot_report import plot_report

        print(f"plot written to {plot_report(report, args.plot)}")
    return 0
