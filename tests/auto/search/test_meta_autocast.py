"""amp_native on the meta device (atorch/amp/meta_autocast.py): autocast's casts emulated, so a
plan counts the activations a real autocast step saves, fp32 where the model keeps fp32.

With CPU autocast's op lists, the emulation on meta tensors saves, dtype by dtype, exactly the
bytes real CPU autocast saves on the same model (Hugging Face Llama with its attention as the
flash kernel on both, GPT-2 and BERT with their masks). A plan uses CUDA's lists."""

import contextlib
import copy

import pytest
import torch

from atorch.amp.meta_autocast import MetaAutocast
from atorch.auto.search.attention import FlashAttentionProbe
from atorch.auto.search.cost import _SavedBytes


def _saved_by_dtype(model, batch: dict, meta: bool, flash: bool) -> dict:
    counter = _SavedBytes([*model.parameters(), *model.buffers()])
    casts = MetaAutocast(torch.bfloat16, counter.weight_cast, "cpu")
    autocast = casts if meta else torch.autocast("cpu", dtype=torch.bfloat16)
    attention = FlashAttentionProbe() if meta and flash else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), counter.casts(), attention:
        with autocast:
            model(**batch)
    # the flash op's random-number state (16-byte seeds), which the CPU kernel keeps elsewhere
    return {dtype: n for dtype, n in counter.by_dtype.items() if dtype != torch.uint64}


def _models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4))  # no GQA: the flash probe repeats k and v, the CPU kernel does not
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4))
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))
    return {"llama": (llama, True), "gpt2": (gpt2, False), "bert": (bert, False)}


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_the_emulated_casts_save_what_real_autocast_saves(name):
    model, flash = _models()[name]
    ids = torch.randint(0, 512, (4, 32))
    batch = {"input_ids": ids, "labels": torch.randint(0, 2, (4,)) if name == "bert" else ids}
    real = _saved_by_dtype(model, batch, meta=False, flash=flash)
    emulated = _saved_by_dtype(copy.deepcopy(model).to("meta"), {k: v.to("meta") for k, v in batch.items()},
                               meta=True, flash=flash)
    assert emulated == real
    assert real[torch.float32] > 0.2 * real[torch.bfloat16]  # what the old term counted at bf16's width


def test_a_weights_casts_are_weights_and_cached_for_the_forward():
    weight = torch.nn.Parameter(torch.randn(8, 8, device="meta"))
    seen = []
    with MetaAutocast(torch.bfloat16, lambda w, cast: seen.append((w, cast))):
        a = torch.nn.functional.linear(torch.randn(2, 8, device="meta"), weight)
        b = torch.nn.functional.linear(torch.randn(2, 8, device="meta"), weight)
        loss = torch.nn.functional.cross_entropy(a + b, torch.zeros(2, dtype=torch.long, device="meta"))
    assert a.dtype == b.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert len(seen) == 1 and seen[0][0] is weight and seen[0][1].dtype == torch.bfloat16


def test_a_weights_cast_on_meta_keeps_its_address_while_the_probe_counts():
    """The emulated casts live for one forward; the counter holds them until the probe ends, as it
    does autocast's on a real device: a freed cast's storage address could come back for a later
    activation, which would then count as a weight (two ranks' probes disagreed that way)."""
    from atorch.auto.search.cost import _storage_key

    weight = torch.nn.Parameter(torch.randn(8, 8, device="meta"))
    counter = _SavedBytes([weight])
    with MetaAutocast(torch.bfloat16, counter.weight_cast):
        torch.nn.functional.linear(torch.randn(2, 8, device="meta"), weight)
    fresh = [torch.ones(8, 8, device="meta") for _ in range(200)]
    assert len(counter.weights) == 2
    assert not {_storage_key(t) for t in fresh} & counter.weights
