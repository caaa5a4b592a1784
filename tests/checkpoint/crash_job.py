"""A job that saves a checkpoint, trains on, and dies by SIGKILL inside its next save.

    python -m tests.checkpoint.crash_job DIR WHERE

WHERE is ``writing`` (after this rank's shard files are written, before DCP's metadata and the
manifest) or ``publishing`` (after the old checkpoint was moved aside, before the new one is
renamed into place). The weights of both saves go to DIR/first.pt and DIR/second.pt.
"""

import os
import signal
import sys

import torch
from torch.distributed.checkpoint import FileSystemWriter

import atorch.checkpoint as ckpt
from atorch.checkpoint import io
from tests.checkpoint.jobs import build, full_weights, train


def _die_after_moving(path: str):
    """os.rename that dies right after it moved ``path`` (the published checkpoint) aside."""
    rename = os.rename

    def wrapped(src, dst):
        rename(src, dst)
        if os.path.abspath(src) == os.path.abspath(path):
            os.kill(os.getpid(), signal.SIGKILL)

    return wrapped


def main(directory: str, where: str) -> None:
    result = build("single")
    train(result, 2)
    ckpt.save(f"{directory}/ckpt", result.model, result.optim, extra={"step": 2})
    torch.save(full_weights(result), f"{directory}/first.pt")
    train(result, 2)
    torch.save(full_weights(result), f"{directory}/second.pt")
    if where == "writing":
        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = original(self, plan, planner)
            future.wait()  # the shard files are on disk; the metadata is not
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    elif where == "publishing":
        io.os.rename = _die_after_moving(f"{directory}/ckpt")
    ckpt.save(f"{directory}/ckpt", result.model, result.optim, extra={"step": 4})
    raise SystemExit("the save finished; it should have been killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
