"""What the ``atorch`` commands share: a model built on the meta device from a flag, a start-up
without the garbage collector, and text folded to the terminal's width."""

import gc
import importlib
import io
import json
import sys
from contextlib import contextmanager

from atorch.utils.text_table import fold

_collector_was_on = True


@contextmanager
def collector_off_for_startup():
    """Run a command with the cyclic garbage collector off until :func:`startup_done`.

    A command's start-up makes millions of objects that all stay alive (torch's and transformers'
    modules, a model on the meta device); the collector's passes over them find nothing and were
    0.6 of the 4.4 CPU s of ``atorch plan --batch-size`` for a 7B model. Afterwards the collector
    is as it was (tests call ``main`` in their own process)."""
    global _collector_was_on
    _collector_was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if _collector_was_on:
            gc.enable()


class _Folding(io.TextIOBase):
    """A text stream that writes each complete line to ``target`` folded within ``width``."""

    def __init__(self, target, width: int):
        self.target, self.width, self.pending = target, width, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.target.write("\n".join(fold(line, self.width)) + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.target.write("\n".join(fold(self.pending, self.width)))
            self.pending = ""
        self.target.flush()


@contextmanager
def folded_stdout(width: int):
    """Inside the block, every line printed to stdout fits ``width`` columns (folded at spaces, its
    continuation indented; no word cut). A command's tables fit on their own; this folds its prose
    (assumptions, notes, reasons). Not for JSON, whose strings must stay whole."""
    stream = _Folding(sys.stdout, width)
    saved, sys.stdout = sys.stdout, stream
    try:
        yield
    finally:
        stream.flush()
        sys.stdout = saved


def startup_done() -> None:
    """The command has imported what it needs and built its model: keep the collector away from
    those objects (``gc.freeze``) and let it collect what the command makes from here on (a long
    plan copies the model per candidate)."""
    gc.freeze()
    if _collector_was_on:
        gc.enable()


def add_model_flags(parser, required: bool = False) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--hf-config", help="a transformers config as JSON (with model_type)")
    source.add_argument("--model", help="module:function returning the model (built on the meta device)")


# Bounds on an --hf-config's sizes: a model of 100000 layers took over a minute and 3.4 GB to build
# on the meta device before anything was planned.
MAX_LAYERS = 512
MAX_SIZE = 2**24


def _hf_model(path: str, auto_config, auto_model, torch):
    """The causal LM of a transformers config file, on the meta device; a ValueError naming the
    file and what is wrong with it otherwise (not a traceback from deep in transformers or torch)."""
    import os
    import stat

    if not os.path.isfile(path) or stat.S_ISFIFO(os.stat(path).st_mode):
        raise ValueError(f"--hf-config {path!r} is not a file (a pipe or a folder would block or fail the read)")
    try:
        with open(path) as file:
            fields = json.load(file)
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as error:
        raise ValueError(f"--hf-config {path!r} is not a JSON config: {error}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ValueError(f"--hf-config {path!r} needs a JSON object with a 'model_type' (e.g. \"llama\"), as a "
                         "transformers config.json has")
    sizes = {k: v for k, v in fields.items() if k.endswith(("_size", "_layers", "_heads")) or k == "vocab_size"}
    bad = {k: v for k, v in sizes.items() if not (isinstance(v, int) and not isinstance(v, bool) and v > 0)
           and v is not None}
    if bad:
        raise ValueError(f"--hf-config {path!r}: sizes must be positive whole numbers, got {bad}")
    over = {k: v for k, v in sizes.items() if v is not None and v > (MAX_LAYERS if k.endswith("_layers") else MAX_SIZE)}
    if over:
        raise ValueError(f"--hf-config {path!r}: {over} is past what atorch plans for (at most {MAX_LAYERS} layers, "
                         f"sizes up to {MAX_SIZE}; the largest published models have about 130 layers)")
    try:
        config = auto_config.for_model(**fields)
        with torch.device("meta"):
            return auto_model.from_config(config)
    except Exception as error:  # noqa: BLE001 - transformers' validators raise their own kinds
        reason = str(error).strip().splitlines()[-1].strip() if str(error).strip() else type(error).__name__
        raise ValueError(f"--hf-config {path!r} does not build a model: {reason}") from None


def build_model(args, dtype=None):
    """The model named by ``--hf-config`` or ``--model``, on the meta device (no memory, no
    download); None when neither was given. ``dtype``: a torch.dtype to cast the model to."""
    if not (getattr(args, "hf_config", None) or getattr(args, "model", None)):
        return None
    import torch  # here, not at the top: `atorch --help` and a validate without a model need no torch

    if getattr(args, "hf_config", None):
        from transformers import AutoConfig, AutoModelForCausalLM

        model = _hf_model(args.hf_config, AutoConfig, AutoModelForCausalLM, torch)
    elif getattr(args, "model", None):
        module_name, _, function = args.model.partition(":")
        if not function:
            raise ValueError("--model takes module:function (a function that returns the model)")
        try:
            make = getattr(importlib.import_module(module_name), function)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"--model {args.model!r}: {type(error).__name__}: {error} (give module:function, the module "
                             "importable from here, the function returning the model)") from None
        with torch.device("meta"):
            model = make()
    else:
        return None
    return model.to(dtype) if dtype is not None else model


# Ranks a plan may ask for: the layouts of a million ranks are listed in seconds; 10**12 took
# minutes and gigabytes, scanning every divisor.
MAX_RANKS = 2**20
# A global batch (sequences) or a sequence length past this is no run anyone plans; 10**100 sequences
# made plan --search list the divisors of the per-rank batch for ever (the fuzz test found it).
MAX_SEQUENCES = 2**30


def positive_int(flag: str, most: int | None = None):
    """An argparse type: a positive int (at most ``most``), refused by name otherwise."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a positive whole number, got {text!r}") from None
        if value < 1 or (most is not None and value > most):
            bound = f" (at most {most})" if most is not None else ""
            raise argparse.ArgumentTypeError(f"{flag} takes a positive whole number{bound}, got {value}")
        return value

    return parse

