"""Pipeline checkpoints: a PipelineModel's stages save their own units, and the checkpoint loads
under DDP, in one process, and back into a pipeline (and a DDP checkpoint into a pipeline)."""

import torch

import atorch.checkpoint as ckpt
from atorch.auto import auto_accelerate
from tests.checkpoint.jobs import full_weights, train
from tests.helpers.compare import FP32_RTOL
from tests.helpers.dist import run_distributed

STRATEGIES = {
    "pipeline": [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_microbatches": 2})],
    "ddp": ["parallel_mode"],
    "single": [],
}


def build_chain(strategy: str, seed: int = 0):
    from tests.pipeline.models import ChainData, chain_loss, chain_model

    _, result, _ = auto_accelerate(chain_model(seed=seed), torch.optim.Adam, ChainData(), chain_loss,
                                   optim_args={"lr": 0.01}, dataloader_args={"batch_size": 8, "shuffle": True},
                                   model_input_format="unpack_dict", load_strategy=STRATEGIES[strategy])
    return result


def _train(result, steps, after=None):
    # The pipeline takes the batch by name (it computes the loss from "target"); nn.Sequential takes the input.
    pipelined = result.args.get("backward_in_forward", False)
    return train(result, steps, after, call=lambda model, batch: model(**batch) if pipelined else model(batch["input"]))


def _save(directory):
    out = {}
    for name in ("pipeline", "ddp"):
        result, out[name] = build_chain(name), {}

        def save(name=name, result=result):
            ckpt.save(f"{directory}/{name}", result.model, result.optim, dataloader=result.dataloader)
            out[name]["weights"] = full_weights(result)

        out[name]["continued"] = _train(result, 8, after={4: save})[4:]
    return out


def _load(directory, saved):
    out = {}
    for source, target in (("pipeline", "ddp"), ("ddp", "pipeline"), ("pipeline", "pipeline")):
        result = build_chain(target, seed=9)
        ckpt.load(f"{directory}/{source}", result.model, result.optim, dataloader=result.dataloader)
        weights = full_weights(result)
        out[source, target] = {
            "same_weights": weights.keys() == saved[source]["weights"].keys()
            and all(torch.equal(weights[k], v) for k, v in saved[source]["weights"].items()),
            "continued": _train(result, 4),
        }
    return out


def _close(actual, expected):
    return len(actual) == len(expected) and all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(actual, expected))


def test_pipeline_checkpoints_reshard(tmp_path):
    saved = run_distributed(_save, 2, str(tmp_path))[0]
    loaded = run_distributed(_load, 2, str(tmp_path), saved)
    for rank in range(2):
        for (source, target), cell in loaded[rank].items():
            assert cell["same_weights"], (source, target)
            assert _close(cell["continued"], saved[source]["continued"]), (source, target, cell, saved[source])
    result = build_chain("single", seed=9)
    ckpt.load(tmp_path / "pipeline", result.model, result.optim, dataloader=result.dataloader)
    for key, value in saved["pipeline"]["weights"].items():
        assert torch.equal(result.model.state_dict()[key], value), key
    assert _close(_train(result, 4), saved["pipeline"]["continued"])
