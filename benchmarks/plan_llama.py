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


# The published presets for these sizes and rank counts, as atorch runs them (docs/plans/
# llama_layouts.md gives their sources): (size, ranks) -> [(source, dims, methods)], matched among
# the plan's own candidates with any accumulation (and fsdp reducing every micro-batch or not).
PUBLISHED = {
    ("7b", 8): [("torchtitan llama2_7b: FSDP, selective AC", {"data": 8},
                 {"amp_native", "checkpoint (selective)", "fsdp"}),
                ("NeMo llama2_7b: TP 2, distributed optimizer", {"tensor": 2, "data": 4},
                 {"tensor_parallel", "amp_native", "zero1"})],
    ("13b", 64): [("torchtitan llama2_13b: FSDP, selective AC", {"data": 64},
                   {"amp_native", "checkpoint (selective)", "fsdp"})],
    ("70b", 64): [("torchtitan llama2_70b: FSDP x TP 8 (sequence parallel), full AC", {"tensor": 8, "data": 8},
                   {"tensor_parallel", "amp_native", "checkpoint", "fsdp", "sequence_parallel"})],
}


def _base_methods(record: dict) -> set:
    return {"fsdp" if m.startswith("fsdp") else m for m in record["methods"]
            if not m.startswith("gradient_accumulation")}


def published(size: str, world: int, records: list) -> list:
    """The fastest candidate of each published preset for this case (the records come ordered)."""
    out = []
    for source, dims, methods in PUBLISHED.get((size, world), []):
        match = next((r for r in records if r["memory_bytes"] is not None and _base_methods(r) == methods
                      and all(r["layout"].get(k, 1) == v for k, v in dims.items())
                      and r["layout"].get("pipeline", 1) == dims.get("pipeline", 1)), None)
        out.append({"source": source, "record": match})
    return out


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
            "counts": dict(result["counts"]), "published": published(size, world, records),
            "nothing_fits": None if fitting else plan_report.nothing_fits(records, result["memory"])}


def row(case: dict) -> list:
    if not case["top"]:
        return [case["model"].upper(), case["world"], case["global_batch"], case["nothing_fits"], "-", "-", "-"]
    best = case["top"][0]
    return [case["model"].upper(), case["world"], case["global_batch"],
            f"{best['layout_text']}; {' + '.join(best['methods'])}", f"{best['memory_bytes']['total'] / GIB:.1f}",
            f"{best['step_seconds']:.3g}", f"{best['mfu']:.1%}"]


def published_rows(case: dict) -> list[list]:
    best = case["top"][0] if case["top"] else None
    out = []
    for item in case.get("published", []):
        r = item["record"]
        if r is None:
            out.append([case["model"].upper(), case["world"], item["source"], "not among the candidates", "-", "-", "-",
                        "-"])
            continue
        fits = "" if r["fits"] else " (over)"
        ratio = f"{r['mfu'] / best['mfu']:.2f}" if best else "-"
        out.append([case["model"].upper(), case["world"], item["source"],
                    f"{r['layout_text']}; {' + '.join(r['methods'])}", f"{r['memory_bytes']['total'] / GIB:.1f}{fits}",
                    f"{r['step_seconds']:.3g}", f"{r['mfu']:.1%}", ratio])
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_llama"))
    args = parser.parse_args(argv)
    cases = [plan("7b", 8)] if args.tiny else [plan(size, world) for size in SIZES for world in WORLDS]
    table = harness.table(["model", "ranks", "global batch (sequences)", "top pick (layout; methods)", "GiB/rank",
                           "step s", "MFU"], [row(case) for case in cases])
    published_table = harness.table(["model", "ranks", "published preset", "as atorch runs it (the fastest such candidate)",
                                     "GiB/rank", "step s", "MFU", "MFU / the pick's"],
                                    [r for case in cases for r in published_rows(case)])
    markdown = ("Estimated on the h100_80gb profile (nothing measured), sequence 4096.\n\n" + table
                + "\n\nPublished presets for these cases, costed as atorch runs them (estimated):\n\n"
                + published_table)
    harness.write(args.out, {"cases": cases}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
