"""The search's decisions replayed without timing: a recorded machine in place of the dry runs.

Every scenario runs ``auto_accelerate``'s full search in one process, with the world size it
names, on real probes of the model (activations, FLOPs: deterministic on a CPU), nominal rates
with a fixed bf16 speedup, and a fixed optimizer rate. The dry runs and the side-by-side timing are replaced by a recorded
machine: each candidate's steps take its own estimate times a factor drawn from a hash of its
strategy and of how many times it ran, and its peak its estimated peak times another such factor.
So the same code gives the same report, to the last digit, run after run; a change to any stage
(the space, the estimates, a pruning rule or its reason, the dry runs' order, the close call, the
tie rules, the pick) shows as a difference from the stored replay in ``replays/`` (gzipped JSON).

    python -m tests.auto.search.replay            # compare every scenario with its replay
    python -m tests.auto.search.replay --record   # write them again (say why in the commit)
"""

import argparse
import contextlib
import gzip
import hashlib
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPLAYS = Path(__file__).parent / "replays"
# bf16's speedup over fp32 on the recorded machine (speedup.py measures a real one): a CPU with
# bf16 instructions, where amp runs faster than fp32.
REPLAY_SPEEDUP = 1.25
# Report fields that a clock sets (when and how long the search ran), not a decision.
CLOCK_FIELDS = ("search_seconds", "created", "stage_seconds")


@dataclass(frozen=True)
class Scenario:
    job: str  # "llama", "bert", "gpt2", "mlp" (benchmarks/search_jobs.py) or "tiny" (tests/helpers/models.py)
    world: int
    size: dict | None = None  # benchmarks.workload.Size fields over TINY
    budget: int | None = None  # bytes; None: the device's memory (24 GiB here)
    excluded: tuple[str, ...] = ()
    included: tuple[str, ...] = ()
    # whether the close call's copies fit the machine together (else it is timed again one by one)
    side_by_side: bool = True
    max_dryruns: int = 8


MIB = 2**20
# Methods the search tries on its pick (refine.py): the recordings predate that stage, which their
# side-by-side timings cannot answer; tests/auto/search/test_refine.py checks it on real timings.
TRIED_ON_PICK = ("fused_optimizer", "native_dynamo")
_SHARDING = ("zero1", "zero2", "fsdp", "mixed_parallel")
# benchmarks/search_quality.py's nine (at their tiny sizes, 4 ranks), its README example (2 ranks),
# and the shapes of tests/auto/search's searches. Budgets are fixed bytes near the plain data
# parallel estimate's fractions that search_quality.py applies to its measured peak.
SCENARIOS = {
    "small": Scenario("llama", 4),
    "memory-bound": Scenario("llama", 4, budget=int(0.40 * MIB)),
    "boundary": Scenario("llama", 4, budget=int(0.33 * MIB), side_by_side=False),
    "deep-narrow": Scenario("llama", 4, {"layers": 4, "seq": 64}, budget=int(0.89 * MIB)),
    "tensor-best": Scenario("llama", 4, {"heads": 4, "seq": 8}, budget=int(0.37 * MIB),
                            excluded=(*_SHARDING, "pipeline_parallel")),
    "pipeline-best": Scenario("llama", 4, {"layers": 4, "seq": 8}, budget=int(0.58 * MIB),
                              excluded=(*_SHARDING, "tensor_parallel")),
    "bert": Scenario("bert", 4),
    "gpt2-tied": Scenario("gpt2", 4, side_by_side=False),
    "mlp-heavy": Scenario("mlp", 4, {"hidden": 64, "seq": 16}, budget=int(1.1 * MIB)),
    "readme": Scenario("readme", 2),
    "tests-tiny": Scenario("tiny", 2),
    "tests-tiny-budget": Scenario("tiny", 2, budget=int(0.5 * MIB), side_by_side=False, max_dryruns=4),
    "tests-tiny-included": Scenario("tiny", 2, included=("checkpoint",), excluded=("zero2",)),
}


def _job(scenario: Scenario):
    """(model, dataset, loss_func, model_input_format, global batch) of a scenario."""
    if scenario.job == "tiny":
        from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

        return TinyTransformer(), TokenDataset(), lm_loss, "unpack_dict", 8
    if scenario.job == "readme":
        sys.path.insert(0, str(Path(__file__).parents[3] / "examples"))
        from train_llama import CountingSequences, build_model, loss_func

        return build_model(128, 64, 2), CountingSequences(16 * 4, 32, 128), loss_func, "unpack_dict", 16
    from benchmarks.search_jobs import JOBS
    from benchmarks.workload import TINY

    size = replace(TINY, **(scenario.size or {}))
    work = JOBS[scenario.job]
    return work.build(size), work.dataset(size), work.loss_func, work.model_input_format, size.global_batch


def _fraction(*parts) -> float:
    """A number in [0, 1) drawn from ``parts`` (the same every run)."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class RecordedMachine:
    """The dry runs' and the side-by-side timing's readings, from each candidate's estimate."""

    def __init__(self, side_by_side: bool):
        self.side_by_side = side_by_side
        self.estimates: dict[str, object] = {}  # the strategy's JSON -> its StepCost
        self.runs: dict[str, int] = {}

    def key(self, strategy) -> str:
        return json.dumps(strategy.to_dict(), sort_keys=True)

    def step_seconds(self, strategy, run: int, count: int) -> list[float]:
        key = self.key(strategy)
        estimate = self.estimates.get(key)
        base = estimate.seconds() if estimate is not None else 0.05
        base *= 0.75 + 0.6 * _fraction(key, "speed")  # how far off the estimate this candidate runs
        return [base * (0.92 + 0.16 * _fraction(key, run, step)) for step in range(count)]

    def peak(self, strategy) -> int | None:
        estimate = self.estimates.get(self.key(strategy))
        if estimate is None:
            return None
        return int(estimate.memory().total * (0.85 + 0.25 * _fraction(self.key(strategy), "peak")))

    def dry_run(self, pristine, strategy, make_context, apply, warmup_steps, timed_steps, timeout_s, global_batch,
                stop_after_s=None) -> dict:
        key = self.key(strategy)
        run = self.runs[key] = self.runs.get(key, 0) + 1
        steps = self.step_seconds(strategy, run, timed_steps)
        return {"reason": None, "throughput": global_batch * len(steps) / sum(steps), "step_seconds": steps,
                "timed_steps": len(steps), "measured_peak_bytes": self.peak(strategy),
                "seconds": sum(steps) * (1 + warmup_steps / timed_steps)}

    def time_side_by_side(self, pristine, strategies, make_context, apply, warmup_steps, timeout_s) -> dict:
        from atorch.auto.search.sidebyside import MIN_TURNS

        turns = [self.step_seconds(s, "side by side", MIN_TURNS) for s in strategies]
        return {"reason": None, "turn_seconds": turns, "seconds": sum(map(sum, turns))}

    def fits_together(self, *args, **kwargs) -> bool:
        return self.side_by_side


def _patched_everywhere(stack: contextlib.ExitStack, original, fake) -> None:
    """Replace ``original`` by ``fake`` in every atorch module that holds it under any name."""
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("atorch"):
            continue
        for name, value in list(vars(module).items()):
            if value is original:
                setattr(module, name, fake)
                stack.callback(setattr, module, name, original)


@contextlib.contextmanager
def recorded(scenario: Scenario):
    """The recorded machine in place of this one's clocks, memory and calibration."""
    import atorch.auto.search.engine  # noqa: F401 - every module that binds the patched names
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import calibrate, cost, dryrun, sidebyside, speedup

    machine = RecordedMachine(scenario.side_by_side)
    build_cost = cost.build_cost

    def remembered(model, strategy, *args, **kwargs):
        estimate = build_cost(model, strategy, *args, **kwargs)
        machine.estimates[machine.key(strategy)] = estimate
        return estimate

    device = DeviceContext(scenario.world, scenario.world, torch.device("cpu"), None, 24 * 2**30)
    with contextlib.ExitStack() as stack:
        _patched_everywhere(stack, cost.build_cost, remembered)
        _patched_everywhere(stack, dryrun.dry_run, machine.dry_run)
        _patched_everywhere(stack, sidebyside.time_side_by_side, machine.time_side_by_side)
        _patched_everywhere(stack, sidebyside.fits_together, machine.fits_together)
        _patched_everywhere(stack, calibrate.cached_rates, lambda *args, **kwargs: (None, "nominal rates (replay)"))
        _patched_everywhere(stack, cost.optimizer_seconds_per_byte, lambda *args, **kwargs: 2.5e-10)
        _patched_everywhere(stack, speedup.half_speedup, lambda *args, **kwargs: (REPLAY_SPEEDUP, "replay"))
        stack.enter_context(_patched_attribute(DeviceContext, "detect", classmethod(lambda cls: device)))
        yield machine


@contextlib.contextmanager
def _patched_attribute(owner, name, value):
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def replay(name: str, report_dir: Path) -> dict:
    """The scenario's search, on the recorded machine: its report (clock fields left out) and pick."""
    from atorch import auto_accelerate
    from atorch.auto.search.report import SearchReport
    from atorch.utils.log import quiet

    scenario = SCENARIOS[name]
    torch.manual_seed(0)
    model, dataset, loss_func, input_format, batch = _job(scenario)
    path = report_dir / f"{name}.json"
    kwargs = {"memory_budget": scenario.budget} if scenario.budget is not None else {}
    with recorded(scenario), quiet():
        status, _, strategy = auto_accelerate(
            model, torch.optim.AdamW, dataset, loss_func, optim_args={"lr": 1e-3},
            dataloader_args={"batch_size": batch, "shuffle": True}, model_input_format=input_format,
            # recorded before the search tried methods on its pick (refine.py): those stay out
            excluded=[*scenario.excluded, *TRIED_ON_PICK], included=list(scenario.included) or None,
            use_search_cache=False, search_only=True, report_file=str(path), max_dryruns=scenario.max_dryruns,
            **kwargs)
    loaded = SearchReport.load(path)
    loaded.search_seconds, loaded.created, loaded.stage_seconds = 0.0, None, None  # what a clock set, not a decision
    report = loaded.to_dict()
    for field in CLOCK_FIELDS:
        report.pop(field)
    return {"pick": strategy.to_dict() if status else None, "report": report,
            "table": loaded.table(width=120).splitlines()}


def stored(name: str) -> dict:
    return json.loads(gzip.decompress((REPLAYS / f"{name}.json.gz").read_bytes()))


def store(name: str, result: dict) -> None:
    text = json.dumps(result, indent=0, sort_keys=True) + "\n"
    (REPLAYS / f"{name}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))


def differences(expected, actual, where: str = "") -> list[str]:
    """Where two replays differ (paths into the JSON, with both values), the first 20."""
    found: list[str] = []
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            found += differences(expected.get(key, "<missing>"), actual.get(key, "<missing>"), f"{where}.{key}")
    elif isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        for index, (a, b) in enumerate(zip(expected, actual)):
            found += differences(a, b, f"{where}[{index}]")
    elif expected != actual:
        found.append(f"{where}: {expected!r} -> {actual!r}")
    return found[:20]


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="write the replays again")
    parser.add_argument("names", nargs="*", default=list(SCENARIOS))
    args = parser.parse_args(argv)
    REPLAYS.mkdir(exist_ok=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            result = replay(name, Path(tmp))
            report = result["report"]
            picked = None if report["winner"] is None else report["candidates"][report["winner"]]["strategy"]
            summary = f"{name}: pick {picked and [m['name'] for m in picked['methods']]}, dry-run {report['dry_run']}"
            if args.record:
                store(name, result)
                print("recorded", summary)
                continue
            diff = differences(stored(name), json.loads(json.dumps(result)))
            failed += bool(diff)
            print(("DIFFERS " if diff else "same ") + summary, *diff, sep="\n  ")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
