"""The resume matrix (issue 56): a tiny Llama, tied and untied, saved under each strategy after 3
steps and loaded in new processes under each strategy; run on 2 ranks.

Without dropout every load continues as the saved strategy's own run did (fp32, within
``CROSS_RTOL``: the two strategies may reduce in different orders). With dropout the masks a
strategy draws are its own (a data rank draws for its share of the batch, a pipeline stage for its
layers), so across strategies the check is that every load runs with the random streams the new
strategy needs, with the saved weights; under the same strategy the streams are restored and the
resumed run equals the uninterrupted one to the last digit.
"""

import torch

import atorch.checkpoint as ckpt
from atorch.auto import auto_accelerate
from tests.checkpoint.jobs import full_weights, train

TENSOR2 = ([("tensor", 2)], None)
PIPELINE2 = ([("pipeline", 2)], None)
STRATEGIES = {
    "ddp": ["parallel_mode"],
    "zero1": ["parallel_mode", "zero1"],
    "zero2": ["parallel_mode", "zero2"],
    "fsdp": ["parallel_mode", "fsdp"],
    "tensor": [("parallel_mode", TENSOR2), "tensor_parallel"],
    "pipeline": [("parallel_mode", PIPELINE2), ("pipeline_parallel", {"num_microbatches": 2})],
    "mixed": [("mixed_parallel", {"tensor_size": 2, "pipeline_size": 1, "num_microbatches": 2})],
}
MODELS = ("tied", "untied")
DROPOUT = 0.1
CROSS_RTOL = 1e-5  # fp32: data, tensor and pipeline ranks sum in different orders
SAVED_AT, CONTINUED = 3, 3


def all_pairs() -> list[tuple[str, str]]:
    return [(source, target) for source in STRATEGIES for target in STRATEGIES]


def cycle_pairs() -> list[tuple[str, str]]:
    """Each strategy saved once and loaded once, each under another (the default run's subset)."""
    names = list(STRATEGIES)
    return [(name, names[(i + 1) % len(names)]) for i, name in enumerate(names)]


def build(strategy: str, model: str, dropout: float, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf import VOCAB, CountingTokens

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=dropout, tie_word_embeddings=model == "tied")
    _, result, _ = auto_accelerate(LlamaForCausalLM(config), torch.optim.AdamW, CountingTokens(),
                                   lambda batch, out: out.loss, optim_args={"lr": 1e-2},
                                   dataloader_args={"batch_size": 8, "shuffle": True},
                                   model_input_format="unpack_dict", load_strategy=STRATEGIES[strategy])
    return result


def _pipelined(result) -> bool:
    return bool(result.args.get("backward_in_forward"))


def _train(result, steps: int, after=None) -> list[float]:
    # A pipeline computes the loss inside its call; its call returns the global loss.
    if _pipelined(result):
        return train(result, steps, after, call=lambda model, batch: model(**batch))
    return train(result, steps, after)


def save_all(directory: str, sources: list[str]) -> dict:
    """Each source strategy, each model, with and without dropout: 3 steps, save, 3 more."""
    out = {}
    for source in sources:
        for model in MODELS:
            for dropout in (0.0, DROPOUT):
                key = f"{source}-{model}-{dropout}"
                result = build(source, model, dropout)
                torch.manual_seed(5)
                out[key] = {}

                def save(key=key, result=result):
                    ckpt.save(f"{directory}/{key}", result.model, result.optim, dataloader=result.dataloader)
                    out[key]["weights"] = full_weights(result)

                out[key]["continued"] = _train(result, SAVED_AT + CONTINUED, after={SAVED_AT: save})[SAVED_AT:]
    return out


def load_all(directory: str, saved: dict, pairs: list[tuple[str, str]]) -> dict:
    """Every pair, each model, with and without dropout, loaded into a job built with other weights."""
    out = {}
    for source, target in pairs:
        for model in MODELS:
            for dropout in (0.0, DROPOUT):
                key = f"{source}-{model}-{dropout}"
                result = build(target, model, dropout, seed=3)
                torch.manual_seed(99)  # the load replaces this where the checkpoint holds a stream
                ckpt.load(f"{directory}/{key}", result.model, result.optim, dataloader=result.dataloader)
                weights = full_weights(result)
                same = weights.keys() == saved[key]["weights"].keys() and all(
                    torch.equal(weights[name], value) for name, value in saved[key]["weights"].items())
                out[source, target, model, dropout] = {"same_weights": same, "continued": _train(result, CONTINUED)}
    return out
