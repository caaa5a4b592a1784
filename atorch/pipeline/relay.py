"""Values that skip stages, relayed stage by stage through a traced pipeline.

A traced split sends a value straight from the stage that makes it to every stage that uses it:
BERT's attention mask goes from the first stage to all the others, and so do the labels of a
forward that returns its loss. torch's schedules with several stages per rank (interleaved,
zero bubble) only exchange values between neighbouring stages, so before such a schedule is
built each skipping value is handed on by every stage in between: the stage takes it as one
more input and returns it as one more output, unchanged (no compute, one more send per stage).
"""

import operator

import torch
from torch import fx


def relay_skipping_values(pipe) -> int:
    """Rewrite ``pipe`` (a ``torch.distributed.pipelining.Pipe``) so that every value crosses one
    cut at a time; return how many stage-to-stage hops were added."""
    graph = pipe.split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    order = {node: index for index, node in enumerate(calls)}
    carriers: dict[tuple[fx.Node, int], fx.Node] = {}  # (value, stage) -> that stage's copy of it
    hops = 0
    for index, call in enumerate(calls):
        for position in range(len(call.args)):
            arg = call.args[position]  # read again: handing on rewrites the uses of a stage's output
            source = _source(arg, order)
            if source is None or source >= index - 1:
                continue
            carrier = arg
            for between in range(source + 1, index):
                key = (arg, between)
                if key not in carriers:
                    carriers[key] = _hand_on(pipe, calls[between], carrier, _value_of(pipe, arg, order))
                    hops += 1
                carrier = carriers[key]
            args = list(call.args)
            args[position] = carrier
            call.args = tuple(args)
    if hops:
        graph.lint()
        pipe.split_gm.recompile()
    return hops


def _source(value, order: dict) -> int | None:
    """The stage that makes ``value`` (a node of the split graph), or None (a model input)."""
    if not isinstance(value, fx.Node):
        return None
    if value in order:
        return order[value]
    if value.op == "call_function" and value.target is operator.getitem and value.args[0] in order:
        return order[value.args[0]]
    return None


def _outputs(submodule: torch.nn.Module) -> tuple[fx.Node, list]:
    output = next(node for node in submodule.graph.nodes if node.op == "output")
    value = output.args[0]
    return output, list(value) if isinstance(value, (tuple, list)) else [value]


def _value_of(pipe, value: fx.Node, order: dict) -> torch.Tensor:
    """The traced example of ``value``: the producing stage's output it is."""
    call, item = (value, 0) if value in order else (value.args[0], value.args[1])
    _, values = _outputs(pipe.split_gm.get_submodule(call.target))
    return values[item].meta["val"]


def _hand_on(pipe, call: fx.Node, value: fx.Node, example: torch.Tensor) -> fx.Node:
    """Make stage ``call`` take ``value`` as a last input and return it as a last output; the
    split graph's node for that output."""
    graph = pipe.split_gm.graph
    submodule = pipe.split_gm.get_submodule(call.target)
    inner = submodule.graph
    placeholders = [node for node in inner.nodes if node.op == "placeholder"]
    if value in call.args:  # the stage uses the value itself: it returns the input it already takes
        # (taking it twice would make the stage receive it twice while its sender sends it once)
        taken = placeholders[call.args.index(value)]
    else:
        with inner.inserting_after(placeholders[-1]):
            taken = inner.placeholder(f"relayed_{value.name}")
        taken.meta["val"] = example
    output, values = _outputs(submodule)
    single = not isinstance(output.args[0], (tuple, list))
    output.args = (tuple(values) + (taken,),)
    submodule.recompile()
    if single:  # the stage returned one value: its users now take item 0 of a tuple
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
    if value not in call.args:
        call.args = tuple(call.args) + (value,)
    users = [user for user in call.users if user.target is operator.getitem]
    with graph.inserting_after(users[-1] if users else call):
        return graph.call_function(operator.getitem, (call, len(values)))
