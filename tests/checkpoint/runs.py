"""What the two shared 2-process runs do (conftest.py): the first trains and saves under every
strategy, the second, in new processes, loads each checkpoint under other strategies."""

import torch

import atorch.checkpoint as ckpt
from atorch.auto import auto_accelerate
from atorch.errors import NotSupportedError
from tests.checkpoint.jobs import build, full_weights, train

RESUMED = ("ddp", "fsdp", "zero1", "tp")
SOURCES = ("fsdp", "ddp", "zero1", "tp")
TARGETS = ("ddp", "tp", "fsdp", "zero1")
DROPOUT = 0.1  # resuming must bring the random streams back too
PIPELINES = {
    "pipeline": [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_microbatches": 2})],
    "ddp": ["parallel_mode"],
    "single": [],
}
TP2 = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]


def _same(weights: dict, expected: dict) -> bool:
    return weights.keys() == expected.keys() and all(torch.equal(weights[k], v) for k, v in expected.items())


# Resume: 10 steps straight == 5 steps, save, new processes, load, 5 steps.
def resume_first(directory: str) -> dict:
    out = {}
    for name in RESUMED:
        result = build(name, dropout=DROPOUT)
        torch.manual_seed(7)
        straight = train(result, 10)
        result = build(name, dropout=DROPOUT)
        torch.manual_seed(7)
        half = train(result, 5)
        ckpt.save(f"{directory}/resume_{name}", result.model, result.optim, result.lr_scheduler, result.dataloader,
                  extra={"step": 5})
        out[name] = {"straight": straight, "half": half}
    return out


def resume_second(directory: str) -> dict:
    out = {}
    for name in RESUMED:
        result = build(name, seed=3, dropout=DROPOUT)  # other weights, other random state: load replaces them
        torch.manual_seed(99)
        extra = ckpt.load(f"{directory}/resume_{name}", result.model, result.optim, result.lr_scheduler,
                          result.dataloader)
        out[name] = {"extra": extra, "losses": train(result, 5), "position": result.dataloader.state_dict()}
    return out


# Resharding: saved after 5 steps under each strategy; the source's own steps 6-10 are the reference.
def reshard_save(directory: str) -> dict:
    out = {}
    for name in SOURCES:
        result, out[name] = build(name), {}

        def save(name=name, result=result):
            ckpt.save(f"{directory}/{name}", result.model, result.optim, result.lr_scheduler, result.dataloader)
            out[name]["weights"] = full_weights(result)
            if name == "fsdp":
                ckpt.export(f"{directory}/export", result.model)

        out[name]["continued"] = train(result, 10, after={5: save})[5:]
    return out


def reshard_load(directory: str, saved: dict) -> dict:
    out = {}
    for source in SOURCES:
        for target in TARGETS:
            result = build(target, seed=11)
            ckpt.load(f"{directory}/{source}", result.model, result.optim, result.lr_scheduler, result.dataloader)
            out[source, target] = {"same_weights": _same(full_weights(result), saved[source]["weights"]),
                                   "continued": train(result, 5)}
    return out


# Pipelines: a PipelineModel's stages save their own units.
def build_chain(strategy: str, seed: int = 0):
    from tests.pipeline.models import ChainData, chain_loss, chain_model

    _, result, _ = auto_accelerate(chain_model(seed=seed), torch.optim.Adam, ChainData(), chain_loss,
                                   optim_args={"lr": 0.01}, dataloader_args={"batch_size": 8, "shuffle": True},
                                   model_input_format="unpack_dict", load_strategy=PIPELINES[strategy])
    return result


def train_chain(result, steps: int, after=None) -> list[float]:
    # The pipeline takes the batch by name (it computes the loss from "target"); nn.Sequential the input.
    pipelined = result.args.get("backward_in_forward", False)
    return train(result, steps, after, call=lambda model, batch: model(**batch) if pipelined else model(batch["input"]))


def pipeline_save(directory: str) -> dict:
    out = {}
    for name in ("pipeline", "ddp"):
        result, out[name] = build_chain(name), {}

        def save(name=name, result=result):
            ckpt.save(f"{directory}/chain_{name}", result.model, result.optim, dataloader=result.dataloader)
            out[name]["weights"] = full_weights(result)

        out[name]["continued"] = train_chain(result, 8, after={4: save})[4:]
    return out


def pipeline_load(directory: str, saved: dict) -> dict:
    out = {}
    for source, target in (("pipeline", "ddp"), ("ddp", "pipeline"), ("pipeline", "pipeline")):
        result = build_chain(target, seed=9)
        ckpt.load(f"{directory}/chain_{source}", result.model, result.optim, dataloader=result.dataloader)
        out[source, target] = {"same_weights": _same(full_weights(result), saved[source]["weights"]),
                               "continued": train_chain(result, 4)}
    return out


# Transformers models: a tensor-parallel GPT-2 (Conv1D layers) and an FSDP Llama export.
def build_gpt2(strategy):
    from tests.helpers.hf import CountingTokens, tiny_gpt2

    _, result, _ = auto_accelerate(tiny_gpt2(), torch.optim.Adam, CountingTokens(), lambda batch, out: out.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=strategy)
    return result


def build_llama(strategy):
    from tests.helpers.hf import CountingTokens, tiny_llama

    _, result, _ = auto_accelerate(tiny_llama(), torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=strategy)
    return result


def transformers_save(directory: str) -> dict:
    from tests.helpers.hf import tiny_llama

    result = build_gpt2(TP2)
    ckpt.save(f"{directory}/gpt2_init", result.model)  # must equal tiny_gpt2() itself
    continued = train(result, 6, after={3: lambda: ckpt.save(f"{directory}/gpt2", result.model, result.optim,
                                                               dataloader=result.dataloader)})[3:]
    _, llama, _ = auto_accelerate(tiny_llama(), torch.optim.Adam, load_strategy=["parallel_mode", "fsdp"])
    ckpt.export(f"{directory}/llama", llama.model)
    return {"gpt2_continued": continued, "llama": full_weights(llama)}


def refused_backends(directory: str) -> dict:
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    _, result, _ = auto_accelerate(TinyTransformer(), torch.optim.Adam, TokenDataset(), lm_loss,
                                   dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                                   load_strategy=["parallel_mode", ("zero2", {"not_use_fsdp": True})])
    try:
        ckpt.save(f"{directory}/fairscale", result.model, result.optim)
    except NotSupportedError as error:
        return {"fairscale": str(error)}
    return {"fairscale": "saved"}


def elastic_reference(directory: str) -> dict:
    """examples/elastic_train.py run straight through (test_elastic.py compares the killed run)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"
    spec = importlib.util.spec_from_file_location("elastic_train", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.train(f"{directory}/elastic", steps=12, save_every=4)


def first(directory: str) -> dict:
    return {"resume": resume_first(directory), "reshard": reshard_save(directory),
            "pipeline": pipeline_save(directory), "transformers": transformers_save(directory),
            "elastic": elastic_reference(directory)}


def second(directory: str, saved: dict) -> dict:
    return {"resume": resume_second(directory), "reshard": reshard_load(directory, saved["reshard"]),
            "pipeline": pipeline_load(directory, saved["pipeline"]), "refused": refused_backends(directory)}
