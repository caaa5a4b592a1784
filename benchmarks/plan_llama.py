"""``atorch plan --search`` for Llama-2 7B, 13B and 70B on 8, 64 and 512 H100s (estimated): the top
pick of each case and the ten fastest, for docs/plans/llama_layouts.md.

    .venv/bin/python benchmarks/plan_llama.py

Sequence 4096; the global batch grows with the ranks as a user sizing these runs would set it:
128k tokens (32 sequences) on 8 ranks, 1M (256) on 64, 4M (1024) on 512. Writes
benchmarks/results/plan_llama.{json,md}. ``--tiny``: 7B on 8 ranks only.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("7b", "13b", "70b")
WORLDS = {8: 32, 64: 256, 512: 1024}  # ranks -> global batch in 4096-token sequences
SEQ = 4096
GIB = 2**30


def plan(size: str, world: int) -> dict:
    import argparse as _argparse

    import torch

    from atorch.auto.search.profiles import load_profile
    from atorch.cli import plan_report
    from atorch.cli.common import build_model
    from atorch.cli.plan_search import plan_search

    model = build_model(_argparse.Namespace(hf_config=str(ROOT / "docs" / "plans" / f"llama{size}.json"), model=None),
                        torch.float32)
    result = plan_search(model, world, WORLDS[world], SEQ, load_profile("h100_80gb"), 2.0, ["fp8", "module_replace"])
    records = plan_report.records(result, world)
    fitting = [r for r in records if r["fits"]]
    return {"model": size, "world": world, "global_batch": WORLDS[world], "top": fitting[:10],
            "counts": dict(result["counts"]),
            "nothing_fits": None if fitting else plan_report.nothing_fits(records, result["memory"])}


def row(case: dict) -> list:
    if not case["top"]:
        return [case["model"].upper(), case["world"], case["global_batch"], case["nothing_fits"], "-", "-", "-"]
    best = case["top"][0]
    return [case["model"].upper(), case["world"], case["global_batch"],
            f"{best['layout_text']}; {' + '.join(best['methods'])}", f"{best['memory_bytes']['total'] / GIB:.1f}",
            f"{best['step_seconds']:.3g}", f"{best['mfu']:.1%}"]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_llama"))
    args = parser.parse_args(argv)
    cases = [plan("7b", 8)] if args.tiny else [plan(size, world) for size in SIZES for world in WORLDS]
    table = harness.table(["model", "ranks", "global batch (sequences)", "top pick (layout; methods)", "GiB/rank",
                           "step s", "MFU"], [row(case) for case in cases])
    markdown = "Estimated on the h100_80gb profile (nothing measured), sequence 4096.\n\n" + table
    harness.write(args.out, {"cases": cases}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
