"""``atorch calibrate``: measure this machine's rates for the search's step-time estimate.

The search reads them from a cache kept per device type and world size (see
:mod:`atorch.auto.search.calibrate`); this command measures them once, or again with
``--refresh``, and prints them::

    atorch calibrate --nproc 2                  # 2 gloo ranks on the CPU
    atorch calibrate --nproc 2 --refresh        # measure again
    torchrun --nproc_per_node 8 -m atorch.cli.main calibrate   # the job's own ranks (NCCL on GPUs)
"""

import json
import os

from atorch.cli.common import positive_int


def add_parser(sub) -> None:
    calibrate = sub.add_parser("calibrate", help="measure this machine's matmul and collective rates for the search "
                               "(cached per device type and world size)")
    calibrate.add_argument("--nproc", type=int, default=2, help="ranks to spawn on this machine (default 2; "
                           "ignored under torchrun, which gives the ranks)")
    calibrate.add_argument("--device", choices=("cpu", "cuda"), default=None,
                           help="default: cuda when available (NCCL), else cpu (gloo)")
    calibrate.add_argument("--threads", type=positive_int("--threads"), default=None,
                           help="CPU threads per rank (default: 1 with more than one rank, as torchrun sets)")
    calibrate.add_argument("--refresh", action="store_true", help="measure again even if a calibration is cached")
    calibrate.add_argument("--cache-dir", default=None, help="where calibrations are kept (default "
                           "$ATORCH_CACHE_DIR/calibration, else $XDG_CACHE_HOME/atorch/calibration, else "
                           "~/.cache/atorch/calibration)")
    calibrate.add_argument("--json", action="store_true", help="print the calibration file's JSON")
    calibrate.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    if args.nproc < 1:
        raise ValueError("--nproc takes a number of ranks, 1 or more")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; calibrate the CPU with --device cpu")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        path, text = _calibrate_here(device, args.refresh, args.cache_dir, args.json)
    elif args.nproc == 1:
        _threads(args.threads, 1)
        path, text = _calibrate_here(device, args.refresh, args.cache_dir, args.json)
    else:
        path, text = _cached_here(args, device) if not args.refresh else (None, None)
        if path is None:  # none cached (or it does not apply): spawn the ranks and measure
            path, text = _spawn(args, device)
    if text is not None:
        print(text)
    return 0


def _threads(threads: int | None, nproc: int) -> None:
    import torch

    if threads is not None or nproc > 1:
        torch.set_num_threads(threads or 1)


def _calibrate_here(device: str, refresh: bool, cache_dir, as_json: bool) -> tuple[str, str | None]:
    """Calibrate on this rank; rank 0 returns the cache path and the text to print."""
    import torch

    import atorch
    from atorch.auto.search.calibrate import cache_path, calibrate
    from atorch.distributed import env

    joined = atorch.init_distributed(backend="nccl" if device == "cuda" else "gloo")
    try:
        where = env.device() if device == "cuda" else torch.device("cpu")
        rates = calibrate(refresh=refresh, directory=cache_dir, device=where)
        path = cache_path(where, env.world_size(), cache_dir)
        if env.rank() != 0:
            return str(path), None
        return str(path), (path.read_text().rstrip() if as_json else describe(rates, str(path)))
    finally:
        if joined:
            atorch.shutdown()


def _cached_here(args, device: str) -> tuple[str | None, str | None]:
    """The calibration the spawned ranks would read, read here without spawning them (starting
    the ranks costs seconds); (None, None) when there is none or it does not apply. The ranks'
    setting (ranks per node, threads per rank) is put in place for the check and restored."""
    import torch

    from atorch.auto.search.calibrate import cache_path, read_cached
    from atorch.auto.search.profiles import profile_from_data

    where = torch.device(device)
    path = cache_path(where, args.nproc, args.cache_dir)
    if not path.is_file():
        return None, None
    saved_env, saved_threads = os.environ.get("LOCAL_WORLD_SIZE"), torch.get_num_threads()
    os.environ["LOCAL_WORLD_SIZE"] = str(args.nproc)
    torch.set_num_threads(args.threads or 1)
    try:
        data, _ = read_cached(path, where)
    finally:
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved_env
    if data is None:
        return None, None
    return str(path), (path.read_text().rstrip() if args.json else describe(profile_from_data(data, path), str(path)))


def _spawn(args, device: str) -> tuple[str, str | None]:
    from atorch.distributed.local import LocalRunError, run_local

    try:
        results = run_local(_calibrate_here, args.nproc, (device, args.refresh, args.cache_dir, args.json),
                            backend="nccl" if device == "cuda" else "gloo", timeout_s=300, threads=args.threads or 1)
    except LocalRunError as error:
        raise RuntimeError(f"calibration failed: {error}") from None
    return results[0]


def describe(rates, path: str) -> str:
    """The calibration as a few lines: matmul rates, then each collective per group size."""
    lines = [f"{rates.description}: calibration in {path}",
             "matmul: " + ", ".join(f"{dtype} {flops / 1e9:.1f} GFLOP/s" for dtype, flops in rates.matmul_flops.items())]
    for kind, by_size in rates.collectives.items():
        for size, link in sorted(by_size.items()):
            lines.append(f"{kind:>15} over {size:>3} ranks: {link.bandwidth / 1e9:8.3f} GB/s, "
                         f"latency {link.latency * 1e6:8.1f} us")
    measured = json.loads(open(path).read()).get("calibration", {})
    if "seconds" in measured:
        lines.append(f"measured in {measured['seconds']:.1f}s ({measured.get('when', '')}); the search uses these rates "
                     f"for {measured.get('world_size')} x {measured.get('device')} jobs (refresh: --refresh)")
    return "\n".join(lines)
