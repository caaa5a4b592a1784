"""The general split: any model whose forward torch.export can capture.

Models with no registered layout (see :mod:`atorch.pipeline.layouts`) are split by tracing:

- **Units** come from the module tree, not from the forward: the repeated blocks (instances of
  ``transformer_layer_cls``, else the items of the model's largest ``nn.ModuleList``) are units,
  every module on the way to them is opened, every other module is one unit, and a module of a
  ``leaf_module_cls`` class is never opened (no cut falls inside it). Units are listed in
  registration order, which is how each rank knows, before any trace, which parameters it holds.
- **The trace** runs when the first batch arrives (torch.export needs example inputs), on a copy
  of the model whose parameters are on the meta device: no memory, whatever the model's size.
  ``torch.distributed.pipelining.pipeline`` cuts the program after the last unit of every stage
  (``SplitPoint.END``), and each rank binds its own real parameters into its stages' programs.
  Values that cross a cut (several tensors, even to a stage further down) are sent by torch's
  traced stages. A new input shape traces again (once per shape).
- **What cannot be traced**: Python control flow on tensor values (``if x.sum() > 0``, a loop
  that stops on a tensor's value) and ops with no meta kernel. The error names the line; the fix
  is cut points on modules with a layout adapter (:func:`atorch.pipeline.register_layout`), or
  a forward without the data-dependent branch.
- **The inputs** are the batch's tensors that the forward takes (``input_ids``,
  ``attention_mask``, ``labels``, ...), or ``input_names`` where given. Each enters the first
  stage and is sent on to the stages that use it, so a padding mask reaches every layer and a
  forward that returns its loss computes it on the last stage.
- **The loss**: the model's own (from traced labels), or ``loss_fn`` with the batch; keyword
  arguments left out of ``input_names`` go to ``loss_fn`` (or, for a Hugging Face model given
  ``labels``, to the model's own ``loss_function``).
"""

import copy
import inspect
import operator
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from atorch.errors import MethodConfigError, NotSupportedError
from atorch.pipeline.layouts import Layout
from atorch.pipeline.relay import relay_skipping_values

# Keyword arguments given to the traced forward when it takes them: no KV cache in training.
_TRACE_FLAGS = {"use_cache": False}


class TracedLayout(Layout):
    """The units of any model, split by tracing its forward on the meta device (see the module doc)."""

    traced = True

    def __init__(self, model: nn.Module, input_names: list[str] | None = None, layer_cls: type | None = None,
                 leaf_cls: tuple[type, ...] = ()):
        direct = [name for name, _ in model.named_parameters(recurse=False)]
        if direct:
            raise NotSupportedError(
                f"PipelineModel does not know how {type(model).__name__}'s forward flows: it splits a model at its "
                f"submodules, and {type(model).__name__} holds parameters itself ({direct}); move them into a "
                "submodule, wrap the model's pieces in an nn.Sequential, or register a layout with "
                "atorch.pipeline.register_layout")
        self.leaf_cls = tuple(leaf_cls)
        layers = _layer_modules(model, layer_cls, self.leaf_cls)
        units = _units(model, "", layers, self.leaf_cls)
        layer_units = [u for u in units if id(model.get_submodule(u)) in layers] or list(units)
        super().__init__(model, units, layer_units, list(input_names or [_default_input(model)]))
        self.named_inputs = list(input_names) if input_names else None
        signature = inspect.signature(model.forward).parameters
        self.flags = {k: v for k, v in _TRACE_FLAGS.items() if k in signature}
        self.forward_args = [n for n, p in signature.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        self.out: _OutputMap | None = None

    def prepare_batch(self, batch: dict) -> dict:
        """Without ``input_names``, every tensor of the batch that the forward takes (in the
        forward's order, labels included) is a traced input: it enters the first stage and is
        handed to the stages that use it, and a forward that computes its loss from labels does so
        on the last stage."""
        if self.named_inputs is None:
            found = [n for n in self.forward_args if isinstance(batch.get(n), torch.Tensor)]
            if found:
                self.inputs = found
        return batch

    def stage_module(self, names, is_first, is_last):
        raise NotSupportedError("a traced model's stages are programs cut from its trace; see atorch.pipeline.traced")

    def shared_units(self) -> list[str]:
        """Units without parameters (rotary tables, masks): every rank keeps their buffers, because
        the forward may run them in another stage than their registration order suggests."""
        return [u for u in self.units if not any(True for _ in self.module(u).parameters())]

    def check_kwargs(self, names):
        untraced = sorted(set(names) & set(self.forward_args) - set(self.inputs) - {"labels"})
        if untraced:
            raise MethodConfigError(
                f"{untraced} are arguments of the model's forward but not traced inputs (input_names is "
                f"{self.inputs}), so the model would run without them; add them to input_names")

    def model_output(self, stage_output, targets):
        output = self.out.rebuild(stage_output)
        labels = targets.get("labels")
        if labels is not None and hasattr(self.model, "loss_function") and hasattr(output, "logits"):
            # input_names left labels out of the trace: the Hugging Face model's loss, computed here
            loss = _hf_loss(self.model, output.logits, labels)
            output = type(output)(**{"loss": loss, **{k: v for k, v in output.items() if k != "loss"}})
        return output

    def trace(self, inputs: tuple[torch.Tensor, ...], stage_units: list[list[str]], adjacent: bool = False):
        """The ``Pipe`` of the model cut after the last unit of every stage but the last, traced on
        the meta device with microbatch ``inputs`` (real or meta: only their shapes are used).
        ``adjacent``: values that skip stages are handed on by each stage in between (schedules
        with several stages per rank exchange values between neighbours only)."""
        from torch.distributed.pipelining import SplitPoint, pipeline

        copy_ = _meta_copy(self.model)
        capture = _Capture(copy_, self.inputs, self.flags)
        split_spec = {f"model.{units[-1]}": SplitPoint.END for units in stage_units[:-1]}
        example = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
        try:
            pipe = pipeline(capture, example, split_spec=split_spec)
        except Exception as error:  # torch.export's errors: data-dependent control flow, graph breaks
            raise NotSupportedError(explain_trace_failure(self.model, error)) from error
        if pipe.num_stages != len(stage_units):
            raise MethodConfigError(
                f"the traced forward of {type(self.model).__name__} splits into {pipe.num_stages} stages at the cuts "
                f"{list(split_spec)}, not {len(stage_units)}: a cut module runs more or less than once, or out of the "
                "order the modules are registered in; pick cuts on modules the forward runs once, in order")
        self._check_order(pipe, copy_, stage_units)
        if adjacent:
            relay_skipping_values(pipe)
        for index in range(pipe.num_stages):
            _drop_dtype_asserts(pipe.get_stage_module(index))
            _contiguous_boundaries(pipe.get_stage_module(index), sends=index < pipe.num_stages - 1)
        try:  # the stages' programs, run in turn on meta tensors: what the ranks will run, without memory
            with torch.no_grad():
                pipe(*example)
        except Exception as error:
            raise NotSupportedError(
                f"{type(self.model).__name__} traces, but the program cut into stages does not run "
                f"({type(error).__name__}: {str(error).splitlines()[0]}); torch.export's unflattening of the trace "
                "can lose the inputs of a module call (seen with a forward decorated with torch.no_grad, such as "
                "Llama's rotary_emb before transformers 5.24). "
                "Fix: a layout (Llama-style decoders have one; "
                "atorch.pipeline.register_layout) or an nn.Sequential of the pieces") from error
        self.out = _OutputMap(pipe, capture)
        return pipe

    def _check_order(self, pipe, traced: nn.Module, stage_units: list[list[str]]) -> None:
        """Each stage's program uses only parameters of its own units (or a tied copy of one): the
        forward runs the units in the order they are registered in."""
        names: dict[int, list[str]] = {}
        for name, param in traced.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        owner = {u: s for s, units in enumerate(stage_units) for u in units}

        def stage_of(fqn):
            return next((owner[u] for u in owner if fqn.startswith(u + ".")), None)

        for index in range(pipe.num_stages):
            for name, param in pipe.get_stage_module(index).named_parameters():
                fqn = name.removeprefix("model.")
                aliases = names.get(id(param), [fqn])
                if index not in {stage_of(a) for a in aliases}:
                    raise MethodConfigError(
                        f"the traced forward uses {fqn} in stage {index}, but by registration order its module is in "
                        f"stage {stage_of(fqn)}: {type(self.model).__name__}'s forward runs its modules in another "
                        "order than they are registered in; give pipeline_cuts that follow the forward's order")

    def bind(self, pipe, index: int, stage_units: list[list[str]], device: torch.device) -> nn.Module:
        """Stage ``index``'s program with this rank's real parameters and buffers in place of the
        meta ones it was traced with, creating its tensors on ``device``."""
        stage = pipe.get_stage_module(index)
        _retarget_devices(stage, device)
        owner = {u: s for s, units in enumerate(stage_units) for u in units}
        for kind, named in (("parameter", stage.named_parameters(remove_duplicate=False)),
                            ("buffer", stage.named_buffers(remove_duplicate=False))):
            for name, traced in list(named):
                fqn = name.removeprefix("model.")
                try:
                    real = self.model.get_parameter(fqn) if kind == "parameter" else self.model.get_buffer(fqn)
                except AttributeError:  # a constant the forward created while it was traced, on meta
                    real = _lifted_constant(fqn, traced, device)
                if real.is_meta:
                    unit = next((u for u in self.units if fqn.startswith(u + ".")), fqn)
                    raise MethodConfigError(
                        f"stage {index}'s traced program uses {kind} {fqn}, but by registration order its module "
                        f"{unit} is in stage {owner.get(unit, '?')}: the forward runs the modules in another order "
                        f"than they are registered (or the model was built on meta and {fqn} was not initialized); "
                        "give pipeline_cuts that follow the forward's order")
                _set_tensor(stage, name, real, kind)
        for module in stage.modules():
            if hasattr(module, "_run_with_interpreter") and "self" not in dict(module.named_children()):
                # Unflattened submodules run node by node in torch.fx.Interpreter by default; their
                # generated code computes the same ops without the per-node Python (except where a
                # child named "self", as in BERT's attention, shadows the generated code's self).
                module._run_with_interpreter = False
        return stage


class _Capture(nn.Module):
    """The model called on its traced inputs, returning the tensors of its output as a flat tuple
    (the output's structure is kept here, to rebuild it on the last stage)."""

    def __init__(self, model: nn.Module, names: list[str], flags: dict):
        super().__init__()
        self.model = model
        self.names, self.flags = names, flags
        # What the traced call saw, kept out of the module's state: torch.export restores a module's
        # attributes (containers included) after tracing.
        self.seen = _outside({})

    def forward(self, *inputs):
        # A copy made before the first unit puts every input in the first stage's program: torch's
        # traced stages hand the model's inputs to the first stage only, and a later stage that
        # uses one (a mask, the labels of a forward that returns its loss) receives it from there.
        inputs = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
        output = self.model(**dict(zip(self.names, inputs)), **self.flags)
        leaves, spec = pytree.tree_flatten(output)
        self.seen()["spec"] = spec
        self.seen()["leaves"] = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _hf_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face model's ``loss_function`` called with the arguments its signature names
    (language models take ``logits`` and ``vocab_size``, classifiers ``pooled_logits`` and ``config``)."""
    function = model.loss_function
    offered = {"logits": logits, "pooled_logits": logits, "labels": labels, "config": model.config,
               "vocab_size": getattr(model.config, "vocab_size", None)}
    named = inspect.signature(function).parameters
    return function(**{k: v for k, v in offered.items() if k in named})


def _outside(value):
    """A function returning ``value``: a closure, which torch.export's attribute snapshot leaves alone."""
    return lambda: value


class _OutputMap:
    """Where each tensor of the model's output is in the last stage's output."""

    def __init__(self, pipe, capture: _Capture):
        graph = pipe.split_gm.graph
        last = [n for n in graph.nodes if n.op == "call_module"][-1]
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.positions = []
        for i, value in enumerate(pytree.tree_leaves(output.args[0])):
            if value is last:
                self.positions.append(None)
            elif value.op == "call_function" and value.target is operator.getitem and value.args[0] is last:
                self.positions.append(value.args[1])
            else:
                raise NotSupportedError(
                    f"tensor {i} of the model's output is computed before the last stage ({value.name}); only the "
                    "last stage's outputs reach the loss: return the loss inputs only (e.g. no cache, no hidden "
                    "states)")
        self.spec, self.leaves = capture.seen()["spec"], capture.seen()["leaves"]

    def rebuild(self, stage_output) -> Any:
        tensors = iter(stage_output if p is None else stage_output[p] for p in self.positions)
        leaves = [next(tensors) if leaf is None else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


def _lifted_constant(fqn: str, traced: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor the forward creates (not a parameter or buffer) was traced on meta, without its
    value; an empty one (Llama's attention creates some) needs none."""
    if traced.numel() == 0:
        return torch.empty(traced.shape, dtype=traced.dtype, device=device)
    raise NotSupportedError(
        f"the forward creates the tensor {fqn} ({tuple(traced.shape)}) from data while it runs; traced on the meta "
        "device it has no value: register it as a buffer of its module (register_buffer) so each rank has it")


def _retarget_devices(stage: nn.Module, device: torch.device) -> None:
    """Ops that create or move tensors were traced with the meta device as an argument (also
    positionally, as in ``aten.to.device``, which torch's own rewrite of ``device=`` misses)."""

    def fix(value):
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        return value

    def retarget(graph: torch.fx.Graph) -> bool:
        changed = False
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = pytree.tree_map(fix, node.args), pytree.tree_map(fix, node.kwargs)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        return changed

    _edit_graphs(stage, retarget)


def _edit_graphs(stage: nn.Module, edit) -> None:
    """``edit(graph)`` on the fx graph of each of the stage's modules (the stage's and its
    unflattened submodules'); where it returns True (it changed the graph), the module's generated
    code is made again (an unflattened module not yet compiled runs its graph as it is)."""
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph) and edit(graph):
            compiled = module if isinstance(module, torch.fx.GraphModule) else getattr(module, "graph_module", None)
            if compiled is not None:
                compiled.recompile()


def _drop_dtype_asserts(stage: nn.Module) -> None:
    """torch.export checks the dtype each traced ``.to``/``.float()`` input had (float32 on meta);
    under amp_native's autocast a matmul before it gives bfloat16/float16, which the op converts
    as the untraced model would. The checks go; the conversions stay."""
    check = torch.ops.aten._assert_tensor_metadata.default

    def drop(graph: torch.fx.Graph) -> bool:
        found = [node for node in graph.nodes if node.op == "call_function" and node.target is check]
        for node in found:
            graph.erase_node(node)
        return bool(found)

    _edit_graphs(stage, drop)


def _contiguous_boundaries(stage: nn.Module, sends: bool = True) -> None:
    """Send and receive contiguous tensors: gloo refuses others, and a traced value crossing a cut
    may be a view (an expanded mask), whose strides torch's traced stage copies into its receive
    buffers. A stage that ``sends`` also sends each value in the dtype it was traced in: under
    amp_native the schedule runs in autocast, whose matmuls give bfloat16/float16 where the trace
    (on meta tensors, which autocast leaves alone) recorded float32, and the next stage's receive
    buffer refused them ("Tensor dtype mismatch")."""
    graph = stage.graph
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and not val.is_contiguous():
            node.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="meta")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")

    def contiguous(node):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return node  # (a traced value's recorded strides may differ from the run's: always copy a view)
        with graph.inserting_before(output):
            if sends and val.is_floating_point():
                node = graph.call_method("to", (node, val.dtype))  # no copy when it already is
            copy_ = graph.call_method("contiguous", (node,))
        copy_.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="meta")
        return copy_

    output.args = (pytree.tree_map(contiguous, output.args[0]),)
    stage.recompile()


def explain_trace_failure(model: nn.Module, error: BaseException) -> str:
    """What in the model's forward stopped torch.export, and what to do about it."""
    cause = error
    while cause.__cause__ is not None and "cannot capture your model" in str(cause):
        cause = cause.__cause__
    frame = _user_frame(cause)
    where = f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()!r})" if frame else ""
    text = str(cause)
    if "data-dependent" in text or "GuardOnDataDependent" in type(cause).__name__ or "DataDependent" in text:
        return (f"PipelineModel cannot trace {type(model).__name__}'s forward{where}: Python control flow on a "
                "tensor's value (an `if`/`while`/`break` on data). torch.export captures one program for every "
                "input of this shape, so the forward must not branch on tensor values. Fix: make that branch "
                "independent of the data (torch.where, or a flag fixed at construction), or split by module names "
                "with a layout adapter (atorch.pipeline.register_layout) or an nn.Sequential of the pieces")
    construct = f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
    return (f"PipelineModel cannot trace {type(model).__name__}'s forward{where}: it raised {construct} when "
            "called with the traced inputs only. Fix: name every input the forward needs in input_names (and, "
            "for pipeline_eligibility, in example_inputs), or split by module names with a layout adapter "
            "(atorch.pipeline.register_layout)")


def _user_frame(error: BaseException):
    """The innermost frame of the traceback outside torch and the standard library."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    stdlib = inspect.__file__.rsplit("/", 1)[0]
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith((torch_dir, stdlib)) and f.filename != __file__]
    if not frames:  # torch.export's message quotes the user's line
        lines = str(error).splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("File ") and i + 1 < len(lines) and "site-packages/torch" not in line:
                name, _, rest = line.strip()[5:].partition(", line ")
                return traceback.FrameSummary(name.strip('"'), int(rest.split(",")[0]), "", line=lines[i + 1])
        return None
    return frames[-1]


def _layer_modules(model: nn.Module, layer_cls: type | None, leaf_cls: tuple) -> set[int]:
    """ids of the repeated blocks: instances of ``layer_cls``, else the items of the largest ModuleList."""
    if layer_cls is not None:
        found = {id(m) for m in _modules_outside_leaves(model, leaf_cls, include_leaves=True) if isinstance(m, layer_cls)}
        if not found:
            raise MethodConfigError(f"transformer_layer_cls {layer_cls.__name__} matches no module of "
                                    f"{type(model).__name__}")
        return found
    lists = [m for m in _modules_outside_leaves(model, leaf_cls) if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return set()
    return {id(m) for m in max(lists, key=len)}


def _modules_outside_leaves(model: nn.Module, leaf_cls: tuple, include_leaves: bool = False):
    stack = [model]
    while stack:
        module = stack.pop()
        is_leaf = module is not model and leaf_cls and isinstance(module, leaf_cls)
        if not is_leaf or include_leaves:
            yield module
        if not is_leaf:
            stack.extend(reversed(list(module.children())))


def _units(module: nn.Module, prefix: str, layers: set[int], leaf_cls: tuple) -> list[str]:
    units = []
    for name, child in module.named_children():
        full = prefix + name
        opened = (id(child) not in layers and not (leaf_cls and isinstance(child, leaf_cls))
                  and any(id(m) in layers for m in child.modules()))
        units += _units(child, full + ".", layers, leaf_cls) if opened else [full]
    return units


def _default_input(model: nn.Module) -> str:
    name = getattr(model, "main_input_name", None)
    if isinstance(name, str):
        return name
    params = [n for n, p in inspect.signature(model.forward).parameters.items()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if not params:
        raise MethodConfigError(f"{type(model).__name__}.forward names no argument; give input_names")
    return params[0]


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are empty meta tensors (ties kept)."""
    memo: dict[int, Any] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        memo.setdefault(id(param), nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad))
    for _, buffer in model.named_buffers(remove_duplicate=False):
        memo.setdefault(id(buffer), torch.empty_like(buffer, device="meta"))
    return copy.deepcopy(model, memo)


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, kind: str) -> None:
    path, _, attr = name.rpartition(".")
    owner = root.get_submodule(path) if path else root
    if kind == "parameter":
        owner._parameters[attr] = value
    else:
        owner._buffers[attr] = value
