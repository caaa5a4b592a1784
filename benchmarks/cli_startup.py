"""How long each ``atorch`` command takes from start to exit (wall and CPU seconds, median of N).

    python -m benchmarks.cli_startup                 # median of 5, a table on stdout
    python -m benchmarks.cli_startup --repeat 3 --only help validate
    python -m benchmarks.cli_startup --out benchmarks/results/cli_startup.md   # the table docs quote

Each command runs as a fresh process (``python -m atorch.cli.main ...``, what the ``atorch``
script runs), so every figure includes Python's and the imports' start-up. CPU seconds are the
child's user + system time. ``import torch`` alone is measured beside them, the floor of any
command that needs torch. Take it with nothing else running (``flock /tmp/atorch-test.lock``
here): timings on a shared 2-core machine move with the load.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report_file(directory: Path, root: Path) -> str:
    """A small search report for ``atorch explain`` (written without importing torch here)."""
    code = (
        "from atorch.auto.search.report import CandidateResult, SearchReport\n"
        "r = SearchReport(2, 'cpu', 2**30, [CandidateResult({'methods': [{'name': 'parallel_mode'}]}, 'measured',"
        " 1000, None, 900, 12.5)], winner=0)\n"
        f"r.save({str(directory / 'report.json')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
    return str(directory / "report.json")


def commands(directory: Path, root: Path = ROOT) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "atorch.cli.main"]
    llama7b = "docs/plans/llama7b.json"
    return {
        "import torch": [sys.executable, "-c", "import torch"],
        "help": cli + ["--help"],
        "validate": cli + ["validate", "strategies/fsdp_bf16_checkpoint.json", "--world-size", "8"],
        "validate --hf-config": cli + ["validate", "strategies/fsdp_bf16_checkpoint.json", "--hf-config",
                                       llama7b, "--world-size", "8"],
        "explain strategy": cli + ["explain", "strategies/zero2_checkpoint.json"],
        "explain report": cli + ["explain", _report_file(directory, root)],
        "plan (states, 7B)": cli + ["plan", "--hf-config", llama7b, "--world-size", "8"],
        "plan --batch-size (7B)": cli + ["plan", "--hf-config", llama7b, "--world-size", "64", "--batch-size", "64",
                                         "--seq-len", "2048"],
        "calibrate --refresh": cli + ["calibrate", "--nproc", "2", "--device", "cpu", "--refresh", "--cache-dir",
                                      str(directory / "calibration")],
        # after the one above: the calibration it wrote is read back
        "calibrate (cached)": cli + ["calibrate", "--nproc", "2", "--device", "cpu", "--cache-dir",
                                     str(directory / "calibration")],
    }


def measure(argv: list[str], root: Path = ROOT) -> tuple[float, float, int]:
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read().decode()
    process.stderr.close()
    if process.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}: {stderr[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, process.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="names of commands to time (default: all)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--out", help="also write the results page (markdown) to this file")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout to run the commands in (another commit's `git archive`, to compare)")
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in commands(Path(tmp), args.root).items():
            if args.only and name not in args.only and name.split()[0] not in args.only:
                continue
            if name == "calibrate (cached)" and args.only and "calibrate --refresh" not in args.only:
                measure(commands(Path(tmp), args.root)["calibrate --refresh"], args.root)  # a calibration to read
            runs = [measure(command, args.root) for _ in range(args.repeat)]
            shown = " ".join(["atorch"] + command[3:]) if command[1:3] == ["-m", "atorch.cli.main"] \
                else " ".join(["python"] + command[1:])
            shown = shown.replace(str(Path(tmp) / "report.json"), "REPORT.json").replace(
                str(Path(tmp) / "calibration"), "DIR")
            rows[name] = {"wall_s": statistics.median(r[0] for r in runs),
                          "cpu_s": statistics.median(r[1] for r in runs), "command": shown}
            print(row(rows[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.out:
        Path(args.out).write_text(results_page(rows, args.repeat, argv if argv is not None else sys.argv[1:]))
    return 0


def row(figures: dict) -> str:
    """One table row, as docs/cli.md and docs/benchmarks.md quote it (tests/test_docs.py)."""
    return f"| `{figures['command']}` | {figures['wall_s']:.2f} | {figures['cpu_s']:.2f} |"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            return next(line.split(":", 1)[1].strip() for line in file if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.system()


def results_page(rows: dict, repeat: int, argv: list[str]) -> str:
    """The results file: the command that wrote it, its date and machine, then the table."""
    import torch  # only for its version, after the timed runs

    command = " ".join(["python -m benchmarks.cli_startup", *argv])
    machine = f"a {os.cpu_count()}-core {platform.machine()} machine ({_cpu_name()}), " + (
        "no GPU" if not torch.cuda.is_available() else torch.cuda.get_device_name())
    today = datetime.date.today().isoformat()
    return "\n".join([
        f"<!-- {command} | {today} | torch {torch.__version__} -->",
        "# `atorch` command start-up",
        "",
        f"{today}, {machine}, torch {torch.__version__}: wall and CPU seconds (the child's user + system",
        f"time) from start to exit, median of {repeat} fresh processes. REPORT.json is a one-candidate search",
        "report, DIR a fresh calibration folder (the cached row reads what the row above wrote).",
        "",
        "| command | wall s | CPU s |",
        "|---|---|---|",
        *(row(figures) for figures in rows.values()),
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
