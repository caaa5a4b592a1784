"""What atorch counts for a model's own loss, and the contract for a loss it cannot see into."""

import logging

import pytest
import torch
import torch.nn.functional as F

from atorch.amp.optimizer import ScaledLossFunc
from atorch.errors import AtorchConfigError
from atorch.loss import TokenSum, with_count
from atorch.loss.contract import CountedLoss, count_of, samples_of
from atorch.loss.counting import LabelRule, rule_for
from tests.helpers.hf import PaddedTokens, tiny_bert, tiny_gpt2, tiny_llama


def padded_batch(n: int = 4) -> dict:
    data = PaddedTokens()
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in data[0]}


def token_sum(logits, labels) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_a_causal_lm_counts_its_shifted_labels(build):
    model, batch = build(), padded_batch()
    rule = rule_for(model)
    assert rule == LabelRule(shift=True)
    out = model(**batch)
    count = rule.count(batch)
    # the loss times the count is the sum over exactly those positions
    expected = token_sum(out.logits[:, :-1], batch["labels"][:, 1:])
    torch.testing.assert_close(out.loss * count, expected, rtol=1e-6, atol=0)
    assert count < (batch["labels"] != -100).sum()  # the first label of each sequence is not counted


def test_a_masked_lm_counts_its_labels_as_they_are():
    model, batch = tiny_bert(), padded_batch()
    del batch["attention_mask"]
    rule = rule_for(model)
    assert rule == LabelRule(shift=False)
    out = model(**batch)
    torch.testing.assert_close(out.loss * rule.count(batch), token_sum(out.logits, batch["labels"]), rtol=1e-6, atol=0)


def test_shift_labels_are_counted_as_given_and_a_plain_module_has_no_rule():
    labels = torch.tensor([[-100, 1, 2], [3, -100, -100]])
    assert int(LabelRule(shift=True).count({"labels": labels, "shift_labels": labels})) == 3
    assert int(LabelRule(shift=True).count({"labels": labels})) == 2
    assert LabelRule(shift=True).count({"input_ids": labels}) is None
    assert rule_for(torch.nn.Linear(2, 2)) is None


def test_the_model_loss_is_marked_with_its_count_and_samples():
    model, batch = tiny_llama(), padded_batch()
    loss = CountedLoss(lambda b, out: out.loss, rule_for(model))(batch, model(**batch))
    assert int(count_of(loss)) == int((batch["labels"][:, 1:] != -100).sum())
    assert samples_of(loss) == 4


def test_a_token_sum_becomes_its_mean_marked_with_its_count():
    model, batch = tiny_llama(), padded_batch()
    out = model(**batch)
    labels = batch["labels"][:, 1:]
    total = token_sum(out.logits[:, :-1], labels)
    loss = CountedLoss(lambda b, o: TokenSum(total, (labels != -100).sum()), None)(batch, out)
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=0)
    assert int(count_of(loss)) == int((labels != -100).sum())
    # with_count marks a mean in place; a (loss, extra) tuple keeps its extra
    mean = with_count(out.loss.clone(), 7)
    assert int(count_of(mean)) == 7
    pair = CountedLoss(lambda b, o: (with_count(o.loss, 5), "extra"), None)(batch, out)
    assert int(count_of(pair[0])) == 5 and pair[1] == "extra"
    with pytest.raises(TypeError, match="int or an integer tensor"):
        with_count(out.loss, 2.5)


def test_a_padded_batch_with_an_unknown_loss_warns_once(caplog):
    model, batch = tiny_llama(), padded_batch()
    counted = CountedLoss(lambda b, out: out.logits.float().mean(), rule_for(model))
    with caplog.at_level(logging.WARNING, logger="atorch"):
        for _ in range(3):
            loss = counted(batch, model(**batch))
    assert count_of(loss) is None
    warnings = [r for r in caplog.records if "TokenSum" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "per_part_mean" in warnings[0].getMessage()
    caplog.clear()
    # chosen explicitly: no warning, one per part
    chosen = CountedLoss(lambda b, out: out.logits.float().mean(), rule_for(model), "per_part_mean")
    with caplog.at_level(logging.WARNING, logger="atorch"):
        loss = chosen(batch, model(**batch))
    assert int(count_of(loss)) == 1 and "TokenSum" not in caplog.text


def test_fp16_loss_scaling_keeps_the_count():
    model, batch = tiny_llama(), padded_batch()
    scaled = ScaledLossFunc(CountedLoss(lambda b, out: out.loss, rule_for(model)), torch.amp.GradScaler("cpu"))
    loss = scaled(batch, model(**batch))
    assert int(count_of(loss)) == int((batch["labels"][:, 1:] != -100).sum())


def test_an_unknown_normalization_is_refused_by_name():
    from atorch.auto import auto_accelerate

    with pytest.raises(AtorchConfigError, match="loss_normalization='token'.*'tokens'.*'per_part_mean'"):
        auto_accelerate(tiny_llama(), torch.optim.SGD, PaddedTokens(), lambda b, out: out.loss, optim_args={"lr": 0.1},
                        dataloader_args={"batch_size": 4}, model_input_format="unpack_dict", load_strategy=[],
                        loss_normalization="token")


def test_a_causal_lm_that_computes_its_own_unshifted_loss_is_not_shifted():
    # BartForCausalLM takes labels already shifted and compares them position by position.
    from transformers import BartConfig, BartForCausalLM

    torch.manual_seed(0)
    model = BartForCausalLM(BartConfig(vocab_size=96, d_model=16, decoder_layers=1, encoder_layers=1,
                                       decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=16,
                                       encoder_ffn_dim=16))
    batch = padded_batch()
    del batch["attention_mask"]
    assert rule_for(model) == LabelRule(shift=False)
    out = model(**batch)
    torch.testing.assert_close(out.loss * rule_for(model).count(batch), token_sum(out.logits, batch["labels"]),
                               rtol=1e-6, atol=0)
