"""Tiny Hugging Face models built from configs (no download), optionally with LoRA adapters."""

import torch

from atorch.auto import auto_accelerate
from tests.helpers.models import linear_dtypes, local_numel, optimizer_state_numel, replicated_params, train_steps

VOCAB, SEQ = 96, 16


def tiny_llama(seed: int = 0, lora: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        # peft starts lora_B at zero; give it values so the adapters change the output from step 0.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


class UnmaskedPadding(torch.utils.data.Dataset):
    """PaddedTokens without the attention mask (module-level, so spawned ranks can build it)."""

    def __init__(self, n: int = 64):
        self.data = PaddedTokens(n, mask=False)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class EmptySecondBatch(torch.utils.data.Dataset):
    """PaddedTokens whose samples ``empty[0]`` to ``empty[1] - 1`` have no label at all (by
    default 8 to 15: the second global batch of 8)."""

    def __init__(self, n: int = 64, empty: tuple[int, int] = (8, 16)):
        self.data, self.empty = PaddedTokens(n), empty

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        item = dict(self.data[i])
        if self.empty[0] <= i < self.empty[1]:
            item["labels"] = torch.full_like(item["labels"], -100)
        return item


class CountingTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = SEQ):
        gen = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        self.tokens = (start + torch.arange(seq)) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class PaddedTokens(torch.utils.data.Dataset):
    """What a tokenizer and a collator give: right-padded sequences of 2 to ``seq`` tokens, the
    padding masked out (``attention_mask`` 0) and ignored by the loss (``labels`` -100). Samples
    carry very different numbers of label tokens, so a mean of per-part means is not the batch's
    token mean (issue 51). ``mask=False`` leaves the attention mask out (the labels alone mark the
    padding: with right padding and causal attention the loss is the same)."""

    def __init__(self, n: int = 64, seq: int = SEQ, pad_id: int = 0, mask: bool = True):
        self.with_mask = mask
        gen = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(1, VOCAB, (n, seq), generator=gen)
        lengths = torch.randint(2, seq + 1, (n,), generator=gen)
        self.mask = (torch.arange(seq) < lengths[:, None]).long()
        self.tokens[self.mask == 0] = pad_id

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = self.tokens[i].masked_fill(self.mask[i] == 0, -100)
        if not self.with_mask:
            return {"input_ids": self.tokens[i], "labels": labels}
        return {"input_ids": self.tokens[i], "attention_mask": self.mask[i], "labels": labels}


def train_hf(load_strategy, steps: int = 5, lora: bool = False, lr: float = 1e-2, micro_batches: int = 1,
             param_dtype: torch.dtype | None = None) -> dict:
    """Train the tiny Llama through auto_accelerate (see models.train_steps for the last two)."""
    model = tiny_llama(lora=lora)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    _, result, strategy = auto_accelerate(
        model, torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss, optim_args={"lr": lr},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", load_strategy=load_strategy,
    )
    with linear_dtypes(result.model) as dtypes:
        steps_out = train_steps(result, steps, micro_batches=micro_batches, param_dtype=param_dtype)
    from torch.distributed.tensor import DTensor

    def full(p):
        return p.full_tensor() if isinstance(p, DTensor) else p

    frozen_unchanged = all(
        torch.equal(full(p).detach(), frozen_before[n]) for n, p in model.named_parameters() if n in frozen_before
    )
    return {
        **steps_out,
        "replicated": replicated_params(result.model),
        "linear_dtypes": sorted(str(d) for d in dtypes),
        "strategy": strategy.to_json(),
        "frozen_unchanged": frozen_unchanged,
        "n_frozen": len(frozen_before),
        "state_numel": optimizer_state_numel(result.optim),
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "param_numel": local_numel(model.parameters()),
    }


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


BUILDERS = {"llama": lambda: tiny_llama(), "gpt2": tiny_gpt2, "bert": tiny_bert}


def train_family(family: str, load_strategy, steps: int = 5, lr: float = 1e-2) -> dict:
    """Train one of the tiny transformers families through auto_accelerate; global losses."""
    model = BUILDERS[family]()
    _, result, strategy = auto_accelerate(
        model, torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss, optim_args={"lr": lr},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", load_strategy=load_strategy,
    )
    steps_out = train_steps(result, steps)
    kinds = sorted({type(m).__name__ for m in result.model.modules() if "Parallel" in type(m).__name__})
    return {**steps_out, "replicated": replicated_params(result.model), "strategy": strategy.to_json(),
            "parallel_modules": kinds,
            "non_contiguous": [n for n, p in result.model.named_parameters() if not p.is_contiguous()]}
