"""Pipeline checkpoints: a PipelineModel's stages save their own units; the checkpoint loads under
DDP, back into a pipeline, and in one process (and a DDP checkpoint into a pipeline)."""

import torch

import atorch.checkpoint as ckpt
from tests.checkpoint.runs import build_chain, train_chain
from tests.helpers.compare import FP32_RTOL


def _close(actual, expected):
    return len(actual) == len(expected) and all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(actual, expected))


def test_pipeline_checkpoints_reshard(two_ranks):
    directory, first, second = two_ranks
    saved = first[0]["pipeline"]
    for rank in range(2):
        for (source, target), cell in second[rank]["pipeline"].items():
            assert cell["same_weights"], (source, target)
            assert _close(cell["continued"], saved[source]["continued"]), (source, target, cell, saved[source])
    result = build_chain("single", seed=9)
    ckpt.load(directory / "chain_pipeline", result.model, result.optim, dataloader=result.dataloader)
    for key, value in saved["pipeline"]["weights"].items():
        assert torch.equal(result.model.state_dict()[key], value), key
    assert _close(train_chain(result, 4), saved["pipeline"]["continued"])
