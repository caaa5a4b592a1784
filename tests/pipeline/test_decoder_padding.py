"""A Llama-style decoder (the layout path, not a trace) on a padded batch through 2 pipeline
stages: the attention_mask enters the first stage and is handed on with the hidden states, so every
layer masks the padding as the serial model does (fp32, 1e-5)."""

import pytest
import torch

from tests.helpers.dist import run_distributed


def _padded() -> dict:
    from tests.helpers.hf import VOCAB

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (4, 8), generator=gen)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 5:] = 0  # padded on the right
    mask[2, :3] = 0  # and on the left, where the real tokens would otherwise attend to the padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _llama():
    from tests.helpers.hf import tiny_llama

    return tiny_llama(seed=0)


def _runs() -> dict:
    from tests.pipeline.test_batches import _compare, _serial

    batch = _padded()
    out = {schedule: _compare(_llama, batch, 2, auto_partition=True, schedule=schedule) for schedule in ("1f1b",)}
    # the mask's effect, for scale: the serial loss with and without it
    unmasked = {k: v for k, v in batch.items() if k != "attention_mask"}
    out["mask effect"] = abs(_serial(_llama(), batch, 2)[0] - _serial(_llama(), unmasked, 2)[0])
    return out


def test_a_padded_llama_batch_through_two_stages_equals_serial():
    pytest.importorskip("transformers")
    for rank, result in enumerate(run_distributed(_runs, 2)):
        assert result["mask effect"] > 1e-3, result
        diffs = result["1f1b"]
        assert diffs["grads"] > 0 and diffs["loss"] <= 1e-5 and diffs["grad"] <= 1e-5, (rank, diffs)
