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
    """Why nothing fits, naming the smallest candidate and only changes the plan's own numbers say
    would lower it below ``memory``."""
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
                f"fewer states, a 16-bit model) would help; a smaller batch would not{_more_ranks(smallest, memory)}")
    sequences = _sequences_at_once(smallest)
    one = terms.get("activations", 0) / sequences  # the activations of one sequence at a time
    floor = _peak_with(terms, one)
    held = f", of which {(terms['total'] - states) / GIB:.1f} GiB are activations and what the step holds with them"
    if floor <= memory:
        return (f"{head}{held}; a smaller micro-batch (each {'microbatch' if _pipelined(smallest) else 'data rank'} "
                f"runs {sequences} sequences at once: a smaller global batch, or more accumulation steps or "
                "microbatches), a shorter sequence or more ranks would lower it")
    if _step_peak(terms, one):
        return (f"{head}; its peak is the optimizer step's (weights, optimizer state, gradients and the step's "
                f"temporaries: {floor / GIB:.1f} GiB at one sequence at a time), so a smaller batch would not help"
                f"{_more_ranks(smallest, memory)}")
    already = ("each data rank already runs one sequence at a time" if sequences == 1
               else f"one sequence at a time would still hold {floor / GIB:.1f} GiB")
    return (f"{head}{held}; {already}: a shorter sequence, activation checkpointing or a split of the model "
            "(tensor, pipeline) that divides its activations would lower it")


def _pipelined(record: dict) -> bool:
    return record["layout"].get("pipeline", 1) > 1 or record["layout"].get("microbatches", 1) > 1


def _sequences_at_once(record: dict) -> int:
    """Sequences one forward of the candidate runs: its per-rank batch over the accumulation steps
    and the pipeline's microbatches."""
    layout = record["layout"]
    return max(1, record.get("per_rank_batch", 1) // layout.get("accumulation", 1) // layout.get("microbatches", 1))


def _peak_with(terms: dict, activations: float, divide: float = 1.0) -> float:
    """The peak (cost.MemoryEstimate.total) of ``terms`` with ``activations``, and the gradients,
    optimizer state and step temporaries divided by ``divide`` (sharded over that many ranks)."""
    from atorch.auto.step_cost import MemoryEstimate

    get = terms.get
    return MemoryEstimate(params=get("params", 0), grads=get("grads", 0) / divide,
                          optim_state=get("optim_state", 0) / divide, gathered=get("gathered", 0),
                          activations=activations, step_temp=get("step_temp", 0) / divide,
                          backward_grads=get("backward_grads", 0) / divide, buckets=get("buckets", 0),
                          reduce_temp=get("reduce_temp", 0) / divide).total


def _step_peak(terms: dict, activations: float) -> bool:
    """Whether the peak is the optimizer step's (or the gradients' reduction), not forward's and
    backward's, with ``activations``."""
    get = terms.get
    return get("grads", 0) + max(get("step_temp", 0), get("reduce_temp", 0)) >= \
        get("gathered", 0) + activations + get("backward_grads", 0)


def _more_ranks(record: dict, memory: int) -> str:
    """How many more ranks, sharding gradients and optimizer state over a data dim (zero2), the
    plan's own numbers say would bring the candidate within ``memory``."""
    terms, world = record["memory_bytes"], record["layout"].get("data", 1) * record["layout"].get("tensor", 1) \
        * record["layout"].get("pipeline", 1)
    activations = terms.get("activations", 0) / _sequences_at_once(record)
    for data in (2, 4, 8, 16, 32, 64):
        if _peak_with(terms, activations, data) <= memory:
            return (f"; {world * data} ranks ({data} times these) sharding or splitting its gradients and optimizer "
                    f"state would bring it to about {_peak_with(terms, activations, data) / GIB:.1f} GiB")
    return "; even 64 times the ranks would not: its weights alone need a split of the model or a smaller one"


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
