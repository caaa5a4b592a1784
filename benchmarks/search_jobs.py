"""The jobs benchmarks/search_quality.py searches: the Llama of benchmarks/workload.py and three
models that are not Llamas, each built from a config (nothing is downloaded):

- ``bert``: a BERT masked LM (an encoder: learned positions, post-norm, GELU, untied head bias);
- ``gpt2``: a GPT-2 LM, its head tied to the token embedding (one weight, two uses);
- ``bert-cls``: a BERT sequence classifier (4 classes, one label a sequence);
- ``mlp``: a parameter-heavy residual MLP (blocks of LayerNorm and a 4x-wide MLP, as ResMLP
  writes them) on ``(input, target)`` batches (``model_input_format="input_target"``): wide layers
  on few samples, so weights, gradients and Adam's state dominate the step's memory. Until
  2026-11-26 it was one flat ``nn.Sequential``: no blocks to checkpoint and no MLP to split, 16
  distinct candidates, too few for the search to cost a tenth of trying them all (two dry runs and
  its fixed cost were 0.27 of the exhaustive time).

Every job is ``(build(size), dataset(size), loss_func, model_input_format)`` of one :class:`Job`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from benchmarks.workload import Size, Tokens, build_llama, loss_func


def build_bert(size: Size, seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                                      num_attention_heads=size.heads, intermediate_size=4 * size.hidden,
                                      max_position_embeddings=size.seq, attn_implementation="sdpa"))


def build_gpt2(size: Size, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=size.vocab, n_embd=size.hidden, n_layer=size.layers,
                                       n_head=size.heads, n_positions=size.seq, bos_token_id=0, eos_token_id=0,
                                       attn_implementation="sdpa"))
    if model.lm_head.weight is not model.transformer.wte.weight:  # the scenario's point: a tied head
        raise RuntimeError("GPT2LMHeadModel no longer ties its head to the token embedding by default")
    return model


class MLPBlock(torch.nn.Module):
    """A pre-norm residual MLP block: ``x + mlp(norm(x))``, its MLP ``Linear(h, 4h), GELU,
    Linear(4h, h)`` in an ``nn.Sequential`` (as ResMLP and MLP-Mixer's channel MLPs are written)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ResidualMLP(torch.nn.Module):
    """``size.seq`` input features, ``size.layers`` :class:`MLPBlock` of ``size.hidden``, a
    classifier over ``size.vocab`` classes."""

    def __init__(self, size: Size):
        super().__init__()
        self.embed = torch.nn.Linear(size.seq, size.hidden)
        self.blocks = torch.nn.ModuleList(MLPBlock(size.hidden) for _ in range(size.layers))
        self.head = torch.nn.Linear(size.hidden, size.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_mlp(size: Size, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ResidualMLP(size)


def build_bert_classifier(size: Size, seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
        intermediate_size=4 * size.hidden, max_position_embeddings=size.seq, num_labels=CLASSES,
        attn_implementation="sdpa"))


CLASSES = 4


class Sentences(Dataset):
    """Token sequences and a class each (the class: the first token mod CLASSES), from a seed."""

    def __init__(self, size: Size, n: int = 4096, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, size.vocab, (n, size.seq), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i, 0] % CLASSES}


class Features(Dataset):
    """``(input, target)`` pairs: ``size.seq`` random features and a class out of ``size.vocab``."""

    def __init__(self, size: Size, n: int = 1024, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, size.seq, generator=gen)
        self.y = torch.randint(0, size.vocab, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def class_loss(batch, output):
    return torch.nn.functional.cross_entropy(output, batch[1])


@dataclass(frozen=True)
class Job:
    build: Callable[[Size], torch.nn.Module]
    dataset: Callable[[Size], Dataset]
    loss_func: Callable
    model_input_format: str


JOBS = {
    "llama": Job(build_llama, Tokens, loss_func, "unpack_dict"),
    "bert": Job(build_bert, Tokens, loss_func, "unpack_dict"),
    "gpt2": Job(build_gpt2, Tokens, loss_func, "unpack_dict"),
    "mlp": Job(build_mlp, Features, class_loss, "input_target"),
    "bert-cls": Job(build_bert_classifier, Sentences, loss_func, "unpack_dict"),
}
