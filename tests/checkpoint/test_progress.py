"""save and load say where they are: a line when they start and one with files, size and time."""

import logging
import os
import re

import torch

import atorch.checkpoint as ckpt
from atorch.utils.log import logger


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_save_and_load_log_their_progress(tmp_path):
    model = torch.nn.Linear(64, 64)
    capture = _Lines()
    logger.addHandler(capture)
    try:
        ckpt.save(tmp_path / "ck", model, torch.optim.SGD(model.parameters(), lr=0.1))
        ckpt.load(tmp_path / "ck", model)
    finally:
        logger.removeHandler(capture)
    text = "\n".join(capture.lines)
    assert f"checkpoint: saving {tmp_path / 'ck'} ..." in text
    assert f"checkpoint: loading {tmp_path / 'ck'} ..." in text
    saved = re.search(r"checkpoint saved to .*: (\d+) files, ([\d.]+)KiB, [\d.]+s", text)
    loaded = re.search(r"checkpoint loaded from .*: (\d+) files checked, ([\d.]+)KiB, [\d.]+s", text)
    assert saved and loaded, text
    assert saved.group(1) == loaded.group(1) and int(saved.group(1)) >= 2  # shards + DCP's .metadata
    assert float(saved.group(2)) >= 64 * 65 * 4 / 1024  # at least the weights


def test_export_counts_the_tensors_it_wrote(tmp_path):
    # transformers' save_pretrained empties the dict it is given: the count is taken before.
    from tests.helpers.hf import tiny_gpt2

    model = tiny_gpt2()
    capture, environment = _Lines(), dict(os.environ)
    logger.addHandler(capture)
    try:
        ckpt.export(tmp_path / "out", model)
    finally:
        logger.removeHandler(capture)
        os.environ.clear()  # save_pretrained's imports (DeepSpeed's accelerator probe) set variables
        os.environ.update(environment)
    written = re.search(r"exported (\d+) tensors", "\n".join(capture.lines))
    tied = {id(p) for p in model.parameters()}
    assert written and int(written.group(1)) >= len(tied) > 0, capture.lines
