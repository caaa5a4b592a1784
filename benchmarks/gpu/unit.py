"""One unit in a process of its own: ``python -m benchmarks.gpu.unit STATE KEY RESULT TIMEOUT``.

Reads the run's config and earlier results from the state file, runs the unit, writes its
result to RESULT as JSON; a failure exits non-zero with the traceback on stderr (in the log).
"""

import json
import sys
from pathlib import Path


def run_unit(state_path: Path, key: str, timeout: float) -> dict:
    from benchmarks.gpu.steps import Run, units

    data = json.loads(Path(state_path).read_text())
    unit = next((u for u in units(data["config"]) if u.key == key), None)
    if unit is None:
        raise KeyError(f"no unit {key!r} in this run")
    results = {k: u["result"] for k, u in data["units"].items() if u["status"] == "done" and "result" in u}
    return unit.run(Run(data["config"], Path(state_path).parent, results), timeout)


def main(argv: list[str]) -> int:
    state_path, key, result_path, timeout = argv
    result = run_unit(Path(state_path), key, float(timeout))
    Path(result_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
