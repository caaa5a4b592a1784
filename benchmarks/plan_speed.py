"""How long ``atorch plan --search`` takes, as a user runs it: the whole command (Python start,
imports, the meta model, every candidate costed), median of several runs.

    .venv/bin/python benchmarks/plan_speed.py --repeats 5

Default: Llama-2 70B on 512 H100s, global batch 1,024 x 4,096 tokens (docs/plans). ``--tiny``
times the 7B config on 8 ranks once (the test suite runs it to show the benchmark works)."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"70b": ("llama70b.json", 512, 1024), "7b": ("llama7b.json", 8, 64)}


def command(job: str) -> list[str]:
    config, world, batch = JOBS[job]
    return [sys.executable, "-m", "atorch.cli.main", "plan", "--search", "--profile", "h100_80gb",
            "--hf-config", str(ROOT / "docs" / "plans" / config), "--world-size", str(world),
            "--batch-size", str(batch), "--seq-len", "4096"]


def time_once(job: str) -> float:
    began = time.perf_counter()
    subprocess.run(command(job), check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--job", choices=sorted(JOBS), default="70b")
    parser.add_argument("--tiny", action="store_true", help="the 7B job on 8 ranks, once")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_speed"))
    args = parser.parse_args(argv)
    job, repeats = ("7b", 1) if args.tiny else (args.job, args.repeats)
    seconds = [time_once(job) for _ in range(repeats)]
    summary = harness.summary(seconds)
    config, world, batch = JOBS[job]
    markdown = (f"`atorch plan --search` for {config} on {world} ranks (h100_80gb), global batch {batch} x 4096: "
                f"median {summary['median']:.1f} s (min {summary['min']:.1f}, max {summary['max']:.1f}) over "
                f"{summary['n']} runs, wall time of the whole command")
    harness.write(args.out, {"job": job, "argv": command(job)[1:], "seconds": seconds, "summary": summary}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
