"""Ranks kept between tests: spawned once, each run joins a fresh process group.

Starting a rank (a Python, torch, atorch, often transformers) costs 1.5-3 s on this machine, more
than most distributed tests take to run, and the suite starts a few hundred. A pool keeps the
ranks of one world size alive: each run sends the function to every rank, which builds a new
gloo group on a new port, calls it and leaves it as :func:`atorch.distributed.local.run_rank` does
for a spawned rank. A world of one is kept too: the single-process reference a distributed test
compares with starts no process of its own either.

What a fresh process would give, a kept one is made to give before each run: the caller's
environment and working folder, torch's default seed, dtype, grad and deterministic modes, the
atorch logger's level and propagation. What the imports made is frozen (``gc.freeze``, as the
search does while it runs; a search in a kept rank finds it frozen and leaves it so): a collection
skips it. Each run collects twice (atorch's ``release_groups`` and the pool's, after it), and over
torch's, transformers' and atorch's objects each took 0.2-0.3 s, more than a small test's run.
After each run, every module-level name of atorch that the run reassigned (the topology
auto_accelerate set, a search's agreement group and timeout, a patched function) is put back, and
so are the contents of its dicts, lists and sets (a method a test registered, a cache); every
module of atorch is imported when a rank starts, so what is put back is what a fresh import left. A
failure or a hang retires the pool (a peer may still wait in a collective), and so do ``MAX_RUNS``
runs; the next run starts fresh ranks. ``ATORCH_TEST_FRESH_RANKS=1`` gives every run new processes
(to rule the pool out when a test fails), as ``run_distributed(..., fresh=True)`` does for one
test. ``ATORCH_TEST_POOL_LOG=FILE`` writes a line a run (its world, the pool's count of runs,
whether the pool was retired) and the names each run reassigned.
"""

import atexit
import logging
import os
import queue as queue_module
import sys

import torch
import torch.multiprocessing as mp

from atorch.distributed.local import LocalRunError, _free_port, run_rank

MAX_WORLD = 4  # larger worlds (slow tests) spawn their ranks each time: eight kept ranks hold GBs
# Runs before a pool is replaced: bounds what a kept rank accumulates. 150 runs of training (DDP,
# FSDP, zero2, tensor parallel, amp with checkpointing) in one kept pair: 435 MB a rank after
# the first, 456 after 25, 457 from 50 on; open files and threads the same throughout.
MAX_RUNS = 200
_pools: dict[int, "Pool"] = {}


def _module_names() -> dict:
    """Every module-level name of atorch, what it holds, and a copy of the dicts, lists and sets it
    holds (a registry a test adds a method to, a cache)."""
    names = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "atorch" or name.startswith("atorch.")):
            continue
        for attr, value in list(vars(module).items()):
            if not attr.startswith("__"):
                names[(module, attr)] = (value, _copy(value))
    return names


def _copy(value):
    if type(value) in (dict, list, set):  # exactly these: subclasses may not copy plainly
        return type(value)(value)
    return None


def _same(value, copy) -> bool:
    """The container holds the same objects as its copy (by identity: tensors do not compare)."""
    if isinstance(value, dict):
        return len(value) == len(copy) and all(k in value and value[k] is v for k, v in copy.items())
    if isinstance(value, list):
        return len(value) == len(copy) and all(a is b for a, b in zip(value, copy))
    return {id(v) for v in value} == {id(v) for v in copy}


def _restore(before: dict) -> list:
    """Put back every atorch module-level name a run reassigned or deleted (the topology it set,
    a timeout, a patched function) and the contents of every dict, list and set it changed (a
    method it registered, what it cached): each as a fresh import left it. Names a run added (lazy
    imports) stay. The names put back, for the log."""
    restored = []
    for (module, attr), (value, copy) in before.items():
        if vars(module).get(attr, _MISSING) is not value:
            setattr(module, attr, value)
            restored.append(f"{module.__name__}.{attr}")
        if copy is not None and not _same(value, copy):
            value.clear()
            value.update(copy) if not isinstance(value, list) else value.extend(copy)
            restored.append(f"{module.__name__}.{attr}[...]")
    return restored


_MISSING = object()


def _reset(environ: dict, cwd: str, seed: int, logger: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    log = logging.getLogger("atorch")
    log.setLevel(logger[0])
    log.propagate = logger[1]


def _import_atorch() -> None:
    """Every module of atorch, so that the state watched before a run holds each one's names as a
    fresh import leaves them (a module first imported inside a run could keep what it set)."""
    import importlib
    import pkgutil

    import atorch

    for info in pkgutil.walk_packages(atorch.__path__, "atorch."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - an optional extra not installed: a run cannot import it either
            pass


def _serve(rank: int, nproc: int, jobs, results, parent: int) -> None:
    import gc

    seed = torch.initial_seed()  # a fresh process's default seed
    _import_atorch()
    log = logging.getLogger("atorch")
    logger = (log.level, log.propagate)
    gc.freeze()  # the imports (see the module docstring)
    while True:
        try:
            job = jobs.get(timeout=5)
        except queue_module.Empty:
            if os.getppid() != parent:  # the test process is gone
                return
            continue
        if job is None:
            return
        port, environ, cwd, fn, args, kwargs = job
        _reset(environ, cwd, seed, logger)
        before = _module_names()
        run_rank(rank, nproc, port, "gloo", 1, fn, args, kwargs,
                 lambda ok, value: results.put(("result", rank, ok, value)))
        restored = _restore(before)
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        gc.collect()
        gc.freeze()  # again: a run may have unfrozen them (atorch.cli's commands do on their way out)
        if restored:
            _log(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}: {restored[:5]}")
        results.put(("ready", rank, True, None))


class Pool:
    def __init__(self, nproc: int):
        ctx = mp.get_context("spawn")
        self.nproc, self.runs = nproc, 0
        self.jobs = [ctx.Queue() for _ in range(nproc)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, nproc, self.jobs[r], self.results, os.getpid()))
                      for r in range(nproc)]
        for proc in self.procs:
            proc.start()

    def run(self, fn, args: tuple, kwargs: dict, timeout_s: float) -> tuple[list, bool]:
        """The results by rank, and whether the ranks can be kept; raises LocalRunError."""
        self.runs += 1
        job = (_free_port(), dict(os.environ), os.getcwd(), fn, args, kwargs)
        for jobs in self.jobs:
            jobs.put(job)
        results, ready, failures = {}, {}, {}
        try:
            while len(results) < self.nproc or len(ready) < self.nproc:
                kind, rank, ok, value = self.results.get(timeout=timeout_s)
                if kind == "ready":
                    ready[rank] = ok
                elif ok:
                    results[rank] = value
                else:
                    failures[rank] = value
                    break
        except queue_module.Empty as error:
            missing = sorted(set(range(self.nproc)) - set(results))
            failures[-1] = f"ranks {missing} did not finish in {timeout_s}s ({error!r})"
        if failures:
            raise LocalRunError("distributed run failed:\n" + "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items()))
        import io

        values = [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(self.nproc)]
        return values, all(ready.values()) and self.runs < MAX_RUNS

    def close(self, kill: bool = False) -> None:
        for jobs, proc in zip(self.jobs, self.procs):
            if not kill and proc.is_alive():
                jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_pooled(fn, nproc: int, args: tuple, kwargs: dict, timeout_s: float) -> list:
    pool = _pools.pop(nproc, None) or Pool(nproc)
    try:
        values, keep = pool.run(fn, args, kwargs, timeout_s)
    except BaseException:
        pool.close(kill=True)
        raise
    if keep:
        _pools[nproc] = pool
    else:
        pool.close()
    _log(f"run: world {nproc}, run {pool.runs} of its ranks{'' if keep else ', retired'}")
    return values


def _log(line: str) -> None:
    """A line to ``ATORCH_TEST_POOL_LOG``'s file, where it is set (see the module docstring)."""
    if os.environ.get("ATORCH_TEST_POOL_LOG"):
        with open(os.environ["ATORCH_TEST_POOL_LOG"], "a") as log:
            log.write(line + "\n")


def pooled(nproc: int) -> bool:
    return 1 <= nproc <= MAX_WORLD and os.environ.get("ATORCH_TEST_FRESH_RANKS") != "1"


@atexit.register
def _close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()
