"""What ``atorch plan --search`` tells the user: one record per candidate with its reason, as the
``--json`` document and as the text table (both from the same records).

Every costed candidate, fitting or not, carries a reason: the fastest that fits "fastest that
fits"; another that fits how much slower it is than the fastest; one over memory by how much and
its largest terms; one without an estimate why. Ineligible layouts are listed with why. When
nothing fits, the smallest candidate is named with the change that would lower it, and a change
that cannot help (a smaller batch when the model states alone are over) is never suggested.
"""

GIB = 2**30

# MemoryEstimate's terms, as a person reads them
TERM_NAMES = {"params": "weights", "grads": "gradients", "optim_state": "optimizer state", "gathered": "gathered weights",
              "activations": "activations", "backward_grads": "gradients during backward", "buckets": "buckets",
              "step_temp": "optimizer step temporaries", "reduce_temp": "reduce-scatter buffers"}
STATE_TERMS = ("params", "grads", "optim_state", "buckets")


def amp_note(excluded) -> str | None:
    """What a plan on the meta device leaves out of amp_native's activations, unless it is excluded."""
    if "amp_native" in (excluded or ()):
        return None
    from atorch.methods.amp_native import META_ACTIVATIONS_NOTE

    return META_ACTIVATIONS_NOTE


def records(result: dict, world: int) -> list[dict]:
    """One JSON-ready record per candidate of :func:`atorch.cli.plan_search.plan_search`'s result,
    fastest fitting first, then over memory (smallest first), then without an estimate."""
    out = []
    for row in result["rows"]:
        record = {"layout": row["dims"], "layout_text": row["layout"], "methods": row["names"], "fits": row.get("fits"),
                  "memory_bytes": None, "step_seconds": None, "tokens_per_second_per_device": None, "mfu": None}
        if "memory" in row:
            terms = {k: int(v) for k, v in row["terms"].items() if k != "forward_flops"}
            record.update(memory_bytes=terms, step_seconds=row["seconds"], mfu=row["mfu"],
                          tokens_per_second_per_device=row["tokens_per_s"] / world)
            record["per_rank_batch"] = row["per_rank_batch"]
        else:
            record["reason"] = row["reason"]
        out.append(record)
    out.sort(key=_order)
    _give_reasons(out, result["memory"])
    return out


def _order(record: dict) -> tuple:
    if record["memory_bytes"] is None:
        return (2, 0.0)
    if record["fits"]:
        return (0, record["step_seconds"], record["memory_bytes"]["total"])
    return (1, record["memory_bytes"]["total"])


def _label(record: dict) -> str:
    return f"{record['layout_text']} with {' + '.join(record['methods']) or 'no method'}"


def _give_reasons(records_: list[dict], memory: int) -> None:
    fitting = [r for r in records_ if r["fits"]]
    best = fitting[0] if fitting else None
    for record in records_:
        if record["memory_bytes"] is None:
            continue
        if record is best:
            record["reason"] = "fastest that fits"
        elif record["fits"]:
            slower = record["step_seconds"] / best["step_seconds"] - 1
            record["reason"] = f"fits; {slower:.0%} slower than the fastest ({_label(best)})"
        else:
            record["reason"] = _over_memory(record["memory_bytes"], memory)


def _largest_terms(terms: dict, count: int = 2) -> str:
    parts = sorted(((v, k) for k, v in terms.items() if k != "total" and v > 0), reverse=True)[:count]
    return ", ".join(f"{TERM_NAMES.get(k, k)} {v / GIB:.1f}" for v, k in parts)


def _over_memory(terms: dict, memory: int) -> str:
    over = terms["total"] - memory
    return f"over memory by {over / GIB:.1f} GiB ({terms['total'] / GIB:.1f} of {memory / GIB:.1f}; largest: " \
           f"{_largest_terms(terms)} GiB)"


def states_bytes(terms: dict) -> int:
    """What a rank holds whatever the batch: weights, gradients, optimizer state and buckets."""
    return sum(terms.get(k, 0) for k in STATE_TERMS)


def nothing_fits(records_: list[dict], memory: int) -> str:
    """Why nothing fits, naming the smallest candidate and only changes that would lower it."""
    costed = [r for r in records_ if r["memory_bytes"] is not None]
    if not costed:
        return "nothing could be costed; the reasons are listed per candidate (--json)"
    smallest = min(costed, key=lambda r: r["memory_bytes"]["total"])
    terms = smallest["memory_bytes"]
    states = states_bytes(terms)
    head = (f"nothing fits {memory / GIB:.1f} GiB per rank; the smallest is {_label(smallest)} at "
            f"{terms['total'] / GIB:.1f} GiB")
    if states > memory:
        return (f"{head}, whose model states alone (weights, gradients, optimizer state) are {states / GIB:.1f} GiB "
                "per rank: only more ranks to shard them over, a smaller model or less state (an optimizer with "
                "fewer states, a 16-bit model) would help; a smaller batch would not")
    rest = terms["total"] - states
    micro = smallest.get("per_rank_batch", 1) // smallest["layout"].get("accumulation", 1)
    if micro > 1:
        change = (f"a smaller micro-batch (each data rank runs {micro} sequences at once: a smaller global batch, or "
                  "one that more accumulation steps divide), a shorter sequence or more ranks would lower it")
    else:
        change = ("each data rank already runs one sequence at a time (with gradient accumulation): a shorter "
                  "sequence or more ranks would lower it")
    return f"{head}, of which {rest / GIB:.1f} GiB are activations and what the step holds with them; {change}"


def document(result: dict, records_: list[dict], header: dict) -> dict:
    """The ``--json`` document."""
    return {**header, "counts": dict(result["counts"]), "memory_per_device_bytes": result["memory"],
            "flops_per_token": result["flops_per_token"], "candidates": records_,
            "ineligible": [{"layout": text, "reason": why} for text, why in result["ineligible"]],
            "nothing_fits": None if any(r["fits"] for r in records_) else nothing_fits(records_, result["memory"])}


def usable_memory(memory: int, reserve: int) -> int:
    """What training may use of ``memory`` per device, ``reserve`` set aside; a reserve that leaves
    nothing is refused by name."""
    if reserve >= memory:
        raise ValueError(f"--reserve {reserve / 2**30:.1f} GiB leaves nothing of the {memory / 2**30:.1f} GiB per device; "
                         "give a smaller --reserve or a larger --memory")
    return memory - reserve
