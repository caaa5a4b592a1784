"""The exhaustive run's best, given what the search's stage 5b gives its own pick.

The search tries the methods that change how a strategy runs, not what a rank holds
(``MethodSpec.tried_on_pick``: the fused optimizer step, torch.compile), on its pick alone; the
exhaustive run dry-runs the search's space, which holds none of them. Its best is then a strategy
the search could have bettered by the same trials, and the search's pick, refined, can run faster
than "the best" (1.215 and 1.280 of it on search_quality.py's held-out BERT and MLP, 2026-11-28).

Here the exhaustive best is given every combination of those methods (the ones this device and
this job can run and the scenario does not exclude), each variant and the search's pick are timed
in the same interleaved blocks, and the best is the fastest of the variants. A variant's warm-up
beyond the quickest one's (a compile) is spread over the search's ``planned_steps`` and added to
each of its steps, as the search charges it; the pick is charged the same way. Every compiled
variant is charged a cold compile (:func:`charged_samples`).
"""

import itertools
import statistics
import time

from benchmarks import harness

PLANNED_STEPS = 1000  # the search's default (SearchOptions.planned_steps)
WARMUP = 2  # steps each variant runs before the interleaved blocks: a compile happens here


def trial_methods(excluded) -> list[str]:
    """The methods the search would try on its pick here, in the order it tries them."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.registry import all_methods

    device_ctx = DeviceContext.detect()
    names = []
    for spec in all_methods():
        if not spec.tried_on_pick or spec.name in (excluded or ()):
            continue
        if all(spec.unsupported is None or spec.unsupported(device_ctx, spec.config_cls(**c)) is None
               for c in spec.search_space):
            names.append(spec.name)
    return names


def variants(best, excluded) -> dict[str, object]:
    """``best`` with every combination of the trial methods it lacks (itself first), by label."""
    methods = [name for name in trial_methods(excluded) if name not in best]
    out = {}
    for count in range(len(methods) + 1):
        for added in itertools.combinations(methods, count):
            strategy = best
            for name in added:
                strategy = strategy.with_method(name)
            out["best" + "".join(f" + {name}" for name in added)] = strategy
    return out


def charged_samples(steps: dict, repeats: int, steps_per_block: int,
                    compiled: frozenset = frozenset()) -> tuple[dict[str, list[float]], dict]:
    """Each variant's seconds a step in interleaved blocks, its extra warm-up (over the quickest
    warm-up) spread over PLANNED_STEPS and added to each; every rank calls it alike. A variant
    whose warm-up fails on any rank is left out (as the search records a failed trial), with why.

    The variants in ``compiled`` compile the same model: the first compiles it, the others reuse
    its kernels in this process (the hidden MLP's fused + compile variant warmed up in 0.06 s after
    compile alone took 19.5 s), and a search that compiled it leaves them too. Each is charged the
    longest of their warm-ups, and at least a cold compile's least (native_dynamo's
    MIN_COMPILE_SECONDS), as a job compiling on a new machine pays."""
    warmups, failed = {}, {}
    for label, step in list(steps.items()):
        start = time.perf_counter()
        _, error = attempted(lambda: [step() for _ in range(WARMUP)])
        if error is not None:
            failed[label] = error
            del steps[label]
            continue
        warmups[label] = harness._slowest(time.perf_counter() - start)
    samples = harness.interleave(steps, repeats, steps_per_block, warmup=0)
    quickest = min(warmups.values())
    warmups = {**warmups, **_compile_charges(warmups, compiled)}
    return {label: [s + (warmups[label] - quickest) / PLANNED_STEPS for s in values]
            for label, values in samples.items()}, {"failed": failed, "warmup_seconds": warmups}


def attempted(call):
    """``(call(), None)``, or ``(None, why)`` where it raised on any rank: every rank agrees, and
    each gets the message of the rank that failed (the search's agreements, agree.py)."""
    from atorch.auto.search.agree import all_ok, first_error

    value, error = None, None
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - a variant this job cannot run (compile on a traced pipeline)
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    if all_ok(error is None):
        return value, None
    return None, first_error(error)


def _compile_charges(warmups: dict[str, float], compiled: frozenset) -> dict[str, float]:
    """The warm-up each compiled variant is charged (see charged_samples)."""
    from atorch.auto.environment import DeviceContext
    from atorch.methods.native_dynamo import MIN_COMPILE_SECONDS

    seen = [warmups[label] for label in compiled if label in warmups]
    if not seen:
        return {}
    device = DeviceContext.detect().device.type
    cold = max(max(seen), MIN_COMPILE_SECONDS.get(device, MIN_COMPILE_SECONDS["cuda"]))
    return {label: cold for label in compiled if label in warmups}


def picked_against_best(build_step, picked, best, excluded, repeats: int, steps_per_block: int) -> dict:
    """The pick timed beside every variant of ``best``: the fastest variant (its label and
    strategy), picked/best throughput, and the charged samples. ``build_step(strategy)`` gives a
    function that runs one optimizer step of it."""
    candidates = variants(best, excluded)
    same = next((label for label, strategy in candidates.items() if strategy == picked), None)
    strategies = {**candidates, **({"picked": picked} if same is None else {})}
    steps, refused = {}, {}
    for label, strategy in strategies.items():  # a variant refused as it is built is left out with why
        step, why = attempted(lambda: build_step(strategy))  # noqa: B023 - called at once
        if why is None:
            steps[label] = step
        else:
            refused[label] = why
    compiled = frozenset(label for label in steps if "native_dynamo" in strategies[label])
    samples, notes = charged_samples(steps, repeats, steps_per_block, compiled)
    notes["failed"].update(refused)
    medians = {label: statistics.median(values) for label, values in samples.items() if label != "picked"}
    fastest = min(medians, key=medians.get)
    picked_median = medians[same] if same is not None else statistics.median(samples["picked"])
    return {"best_label": fastest, "best": candidates[fastest], "ratio": medians[fastest] / picked_median,
            "picked_is": same, "samples": samples, **notes}
