"""The GPU check's report: ``gpu_<device>_<date>.json`` (everything) and ``.md`` (the tables), and
the summary the command prints. Written after every invocation, so a cut run leaves what it has,
with what is still to run.
"""

from pathlib import Path

GIB = 2**30


def _peak(config: dict, calibration: dict | None) -> tuple[float | None, str]:
    """The bf16 FLOP/s MFU is taken against, and where it comes from."""
    if config["device"] == "cuda":
        from benchmarks.gpu.estimate import datasheet_profile

        profile, source = datasheet_profile(config["device_name"])
        if profile is not None:
            return profile.peak("half"), f"{profile.name} profile's bf16 peak: {source}"
    if calibration:
        rate = calibration["profile"]["matmul_flops"].get("bf16")
        if rate:
            return rate, "this device's calibrated bf16 matmul rate (no datasheet peak in the repository for it)"
    return None, "no peak known for this device"


def _device() -> dict:
    import torch

    from benchmarks.harness import machine

    info = machine()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory=props.total_memory,
                    cuda_runtime=torch.version.cuda)
    return info


def build(state, all_units) -> dict:
    config, units = state.data["config"], state.data["units"]
    done = {key: unit["result"] for key, unit in units.items() if unit["status"] == "done"}
    calibration = done.get("calibrate/profile")
    peak, peak_source = _peak(config, calibration)
    problems, tests = [], {}
    for key, result in done.items():
        if key.startswith("tests/"):
            tests[key] = result
            problems += [f"{f['test']}: {f['message']}" for f in result.get("failures", [])]
    statuses = [{"unit": u.key, "status": units.get(u.key, {}).get("status", "pending"),
                 "seconds": units.get(u.key, {}).get("seconds"), "note": units.get(u.key, {}).get("note", "")}
                for u in all_units]
    problems += [f"{s['unit']} failed: {s['note']}" for s in statuses if s["status"] == "failed"]
    bench = []
    keys = {u.key for u in all_units}
    for feature in config["features"]:
        for who in ("plain", "atorch"):
            key = f"bench/{who}-{feature}"
            if key not in keys:
                continue  # the search's twin is plain bf16's row
            row = dict(done.get(key) or {"who": who, "feature": feature})
            row["status"] = units.get(key, {}).get("status", "pending")
            row["note"] = units.get(key, {}).get("note", "")
            if "tokens_per_s" in row and peak:
                row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak
            bench.append(row)
    estimates = []
    estimated = done.get("estimate/cost-model", {})
    for feature in config["features"]:
        measured = done.get(f"bench/atorch-{feature}") or {}
        for profile in estimated.get("profiles", []):
            row = {"feature": feature, "profile": profile, **estimated["rows"].get(f"{profile}/{feature}", {})}
            if measured.get("step_s") and row.get("step_s"):
                row["measured_step_s"] = measured["step_s"]
                row["step_ratio"] = row["step_s"] / measured["step_s"]
            if measured.get("peak_allocated") and row.get("peak_bytes"):
                row["measured_peak"] = measured["peak_allocated"]
                row["peak_ratio"] = row["peak_bytes"] / measured["peak_allocated"]
            estimates.append(row)
    pending = [s["unit"] for s in statuses if s["status"] in ("pending", "running")]
    return {"device": config["device_name"], "slug": config["slug"], "date": state.data["date"],
            "started": state.data["started"], "dry": config["dry"], "config": config, "complete": not pending,
            "pending": pending, "problems": problems, "units": statuses, "tests": tests,
            "calibration": calibration and {k: calibration[k] for k in ("path", "command")} | {
                k: calibration["profile"].get(k) for k in ("matmul_flops", "attention_flops", "memory_bandwidth",
                                                           "op_seconds", "memory", "collectives")},
            "peak_flops": peak, "peak_source": peak_source, "bench": bench, "estimates": estimates,
            "optimizer_seconds_per_byte": estimated.get("optimizer_seconds_per_byte"),
            "offload": done.get("offload/fsdp-cpu-offload"),
            "invocations": state.data.get("invocations", []),
            "state": str(state.path)}


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def markdown(report: dict) -> str:
    from benchmarks.harness import table

    size = report["config"]["size"]
    lines = [f"# GPU check: {report['device']}, {report['date']}" + (" (CPU dry path)" if report["dry"] else ""),
             "",
             f"Started {report['started']}; " + ("complete." if report["complete"] else
                                                 f"**not complete**: {len(report['pending'])} units to run "
                                                 f"({', '.join(report['pending'])})."),
             *(["", "CPU dry path: a tiny Llama on this CPU for two steps. The tables show that the plumbing works; "
                "their numbers measure nothing."] if report["dry"] else []),
             *(["", "Invocations (`python -m benchmarks.gpu` and):", "",
                *[f"- {i['when']}: `{' '.join(i['argv']) or '(no arguments)'}`" for i in report["invocations"]]]
               if report.get("invocations") else []),
             "", "## Tests (pytest -m gpu)", ""]
    if report["tests"]:
        lines.append(table(["unit", "passed", "failed", "errors", "skipped", "collected"],
                           [[key, r.get("passed", "-"), r.get("failed", "-"), r.get("errors", "-"),
                             r.get("skipped", "-"), r.get("collected", "-")] for key, r in report["tests"].items()]))
        failures = [f for r in report["tests"].values() for f in r.get("failures", [])]
        lines += ["", *[f"- FAILED {f['test']}: {f['message']}" for f in failures]]
        skips = [s for r in report["tests"].values() for s in r.get("skips", [])]
        lines += [f"- skipped {s['test']}: {s['reason']}" for s in skips]
    else:
        lines.append("not run yet")
    lines += ["", f"## Llama benchmark ({size['hidden']} hidden, {size['layers']} layers, {size['batch']} x "
                  f"{size['seq']} tokens a step, AdamW)", "",
              (f"MFU against {_rate(report['peak_flops'])}: " if report["peak_flops"] else "No MFU: ")
              + f"{report['peak_source']}.", ""]
    rows = []
    plain = _plain_twins(report)
    for r in report["bench"]:
        twin = plain.get(r["feature"], {})
        ratio = (r["tokens_per_s"] / twin["tokens_per_s"]
                 if r["who"] == "atorch" and r.get("tokens_per_s") and twin.get("tokens_per_s") else None)
        first = r.get("losses", [None])[0]
        rows.append([r["feature"], r["who"], r["status"] + (f" ({r['note']})" if r.get("note") else ""),
                     _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(ratio, ".3f"), _fmt(r.get("mfu"), ".1%"),
                     _fmt(r.get("peak_allocated"), ".2f", 1 / GIB), _fmt(r.get("step_s"), ".1f", 1e3),
                     _fmt(first, ".4f")])
    lines.append(table(["feature", "by", "status", "tokens/s", "atorch / plain", "MFU", "peak GiB", "step ms",
                        "first loss"], rows))
    lines += ["", "## The cost model's estimate beside the measurement (atorch's strategies)", ""]
    if report["estimates"]:
        lines.append(table(["feature", "profile", "est. step ms", "measured step ms", "est / meas", "est. peak GiB",
                            "measured peak GiB", "est / meas"],
                           [[e["feature"], e["profile"], _fmt(e.get("step_s"), ".1f", 1e3),
                             _fmt(e.get("measured_step_s"), ".1f", 1e3), _fmt(e.get("step_ratio"), ".2f"),
                             _fmt(e.get("peak_bytes"), ".2f", 1 / GIB), _fmt(e.get("measured_peak"), ".2f", 1 / GIB),
                             _fmt(e.get("peak_ratio"), ".2f")] if "skipped" not in e and "error" not in e else
                            [e["feature"], e["profile"], e.get("skipped") or e.get("error"), "", "", "", "", ""]
                            for e in report["estimates"]]))
    else:
        lines.append("not run yet")
    if report["calibration"]:
        calibration = report["calibration"]
        rates = [f"matmul {', '.join(f'{k} {_rate(v)}' for k, v in calibration['matmul_flops'].items())}"]
        if calibration.get("attention_flops"):
            rates.append(f"attention {', '.join(f'{k} {_rate(v)}' for k, v in calibration['attention_flops'].items())}")
        if calibration.get("memory_bandwidth"):
            rates.append(f"memory {calibration['memory_bandwidth'] / 1e12:.2f} TB/s")
        lines += ["", f"Calibration ({calibration['command']}): " + "; ".join(rates)
                  + f", {(calibration['op_seconds'] or 0) * 1e6:.1f} us an operator."]
    lines += ["", "## CPU offload (fsdp cpu_offload: benchmarks/gpu/offload.py)", "", *_offload_lines(report)]
    lines += ["", "## Units", "", table(["unit", "status", "seconds", "note"],
                                        [[u["unit"], u["status"], _fmt(u["seconds"], ".0f"), u["note"]]
                                         for u in report["units"]])]
    if report["problems"]:
        lines += ["", "## Problems", "", *[f"- {p}" for p in report["problems"]]]
    return "\n".join(lines)


def _offload_lines(report: dict) -> list[str]:
    """The offload unit's rates beside the profile's, and its measured extra step beside the estimate's."""
    result = report.get("offload")
    if not result:
        return ["not run yet"]
    lines = [f"Host AdamW: {result['host_optimizer_seconds_per_byte']:.3g} s a byte of parameter (the h100_80gb "
             "profile: 9.1e-11, estimated)."]
    if result.get("skipped"):
        return [*lines, f"The rest skipped: {result['skipped']}."]
    lines.append(f"Pinned copies: {result['host_to_device_bandwidth'] / 1e9:.1f} GB/s to the device, "
                 f"{result['device_to_host_bandwidth'] / 1e9:.1f} GB/s back (the profile: 64, the datasheet's).")
    steps = result["step_s"]
    lines.append(f"fully_shard on one rank, median step: {steps['on_device'] * 1e3:.1f} ms on the device, "
                 f"{steps['offload'] * 1e3:.1f} ms with CPUOffloadPolicy: {result['measured_extra_s'] * 1e3:.1f} ms "
                 "more.")
    for name, row in result.get("estimated", {}).items():
        if isinstance(row, dict):
            ratio = "" if row.get("ratio") is None else f", {row['ratio']:.2f}x the measured"
            lines.append(f"Estimated at the {name}: {row['extra_s'] * 1e3:.1f} ms more{ratio}.")
    return lines


def write(report: dict, out_dir: Path) -> tuple[Path, Path]:
    from benchmarks.harness import write as write_result

    out = Path(out_dir) / f"gpu_{report['slug']}_{report['date']}"
    md = write_result(out, report, markdown(report))
    return out.with_suffix(".json"), md


def summary(report: dict) -> str:
    counts = {}
    for unit in report["units"]:
        counts[unit["status"]] = counts.get(unit["status"], 0) + 1
    lines = [f"GPU check on {report['device']}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
    tests = report["tests"].values()
    if tests:
        lines.append("tests: " + ", ".join(f"{sum(r.get(k, 0) for r in tests)} {k}"
                                            for k in ("passed", "failed", "errors", "skipped", "collected")))
    plain = _plain_twins(report)
    for r in report["bench"]:
        if r["who"] == "atorch" and r.get("tokens_per_s"):
            twin = plain.get(r["feature"], {}).get("tokens_per_s")
            vs = f", {r['tokens_per_s'] / twin:.3f} x plain" if twin else ""
            mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
            lines.append(f"bench {r['feature']}: atorch {r['tokens_per_s']:,.0f} tokens/s{vs}{mfu}")
    for e in report["estimates"]:
        if e.get("step_ratio"):
            peak = f", peak {e['peak_ratio']:.2f}" if e.get("peak_ratio") else ""
            lines.append(f"estimate {e['feature']} ({e['profile']}): est/measured step {e['step_ratio']:.2f}{peak}")
    lines += [f"problem: {p}" for p in report["problems"]]
    return "\n".join(lines)


def _plain_twins(report: dict) -> dict:
    """Each feature's plain row; the search's is plain bf16's (the job a user writes by hand)."""
    plain = {r["feature"]: r for r in report["bench"] if r["who"] == "plain"}
    if "bf16" in plain:
        plain.setdefault("search", plain["bf16"])
    return plain
