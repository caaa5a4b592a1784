import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.errors import MethodConfigError
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyTransformer, TokenDataset, lm_loss, train_losses


def _grads_and_calls(strategy):
    torch.manual_seed(0)
    model = TinyTransformer()
    calls = []
    for block in model.blocks:
        # A pre-hook: non-reentrant recomputation stops early, once the saved tensors exist again.
        block.norm1.register_forward_pre_hook(lambda *a: calls.append(1))
    keys = list(model.state_dict())
    _, result, applied = auto_accelerate(model, load_strategy=strategy)
    data = TokenDataset()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    lm_loss(batch, result.model(batch["input_ids"])).backward()
    assert list(result.model.state_dict()) == keys
    return {n: p.grad.clone() for n, p in result.model.named_parameters()}, len(calls), applied


@pytest.mark.parametrize(
    "config", [None, (Block,), ["Block"], {"wrap_class": "Block", "no_reentrant": False}], ids=["auto", "class", "name", "reentrant"]
)
def test_checkpoint_recomputes_blocks_with_identical_grads(config):
    plain_grads, plain_calls, _ = _grads_and_calls([])
    grads, calls, applied = _grads_and_calls([("checkpoint", config)])
    assert plain_calls == 2 and calls == 4  # each block's forward runs again in backward
    for name, grad in plain_grads.items():
        assert torch.allclose(grad, grads[name], atol=1e-6), name
    assert applied.get("checkpoint").wrap_class  # auto-detected classes are still listed in the config


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "under-amp"])
def test_a_checkpointed_hugging_face_model_trains_without_its_kv_cache(amp):
    """A checkpointed layer's recompute would append its keys and values to the KV cache again,
    so the cache grew by a layer's keys and values per block through backward. Under amp, whose
    wrapper hides the forward's arguments, too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from atorch.auto.search.peak import PeakMemory

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

    ids = torch.randint(0, 64, (2, 64))
    amp_method = [("amp_native", "bf16")] if amp else []
    _, result, _ = auto_accelerate(llama(), load_strategy=amp_method)
    plain = result.model
    plain(input_ids=ids, labels=ids).loss.backward()
    _, result, _ = auto_accelerate(llama(), load_strategy=[*amp_method, "checkpoint"])
    model = result.model
    out = model(input_ids=ids, labels=ids)
    assert out.past_key_values is None  # no cache with gradients on
    with PeakMemory(model) as tracked:
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    with PeakMemory(model) as cached:  # control: the cache asked for grows through the recomputes
        model(input_ids=ids, labels=ids, use_cache=True).loss.backward()
    assert cached.peak > 1.3 * tracked.peak, (cached.peak, tracked.peak)
    with torch.no_grad():  # inference keeps the config's cache
        assert model(input_ids=ids).past_key_values is not None


def test_unknown_class_fails_before_anything_is_applied():
    model = TinyTransformer()
    forward = model.forward
    with pytest.raises(MethodConfigError, match="no module of class.*Classes in the model") as error:
        auto_accelerate(model, load_strategy=[("amp_native", "bf16"), ("checkpoint", ["NoSuchBlock"])])
    assert model.forward == forward  # amp_native was not half-applied
    # The message says the fix: an empty list detects the blocks, which it names.
    assert 'write "wrap_class": [] to use the model\'s repeated blocks' in str(error.value)
    assert "(here ['Block'])" in str(error.value)


def test_unknown_class_error_names_the_closest_classes():
    with pytest.raises(MethodConfigError, match=r"Closest class names in the model: \['Block'\]"):
        auto_accelerate(TinyTransformer(), load_strategy=[("checkpoint", ["Blocks"])])


def test_model_without_blocks_needs_explicit_classes():
    with pytest.raises(MethodConfigError, match="no repeated blocks"):
        auto_accelerate(torch.nn.Linear(2, 2), load_strategy=["checkpoint"])


def test_checkpoint_on_2_ranks_matches_single_process():
    strategy = ["parallel_mode", "checkpoint"]
    reference = train_losses(strategy)
    results = run_distributed(train_losses, 2, strategy)
    assert_ranks_agree(results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)


def test_selective_checkpointing_trains_exactly_like_no_checkpointing():
    """Keeping the matmul outputs and recomputing the rest changes no number (fp32)."""
    from tests.helpers.models import train_losses

    plain = train_losses([], steps=3)
    selective = train_losses([("checkpoint", {"selective": True})], steps=3)
    assert selective["strategy"].count('"selective": true') == 1, selective["strategy"]
    for got, want in zip(selective["losses"], plain["losses"]):
        assert abs(got - want) <= 1e-6 * abs(want), (selective["losses"], plain["losses"])


def test_selective_needs_the_non_reentrant_checkpoint():
    import pytest

    from atorch.auto.strategy import Strategy
    from atorch.errors import AtorchConfigError

    with pytest.raises(AtorchConfigError, match="selective=True needs no_reentrant=True"):
        Strategy([("checkpoint", {"selective": True, "no_reentrant": False})]).validate()


def test_selective_is_costed_between_none_and_full_recompute():
    """Full checkpointing runs the blocks' forward again (its FLOPs); selective runs only the
    element-wise operators again (their launches, no matmul FLOPs): its estimated step lies
    between, on a GPU profile."""
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.profiles import load_profile
    from atorch.auto.strategy import Strategy
    from tests.helpers.models import TinyTransformer

    model = TinyTransformer()
    seconds = {}
    for name, methods in (("none", []), ("full", ["checkpoint"]), ("selective", [("checkpoint", {"selective": True})])):
        strategy = resolve_strategy(model, Strategy(methods))
        step = cost.build_cost(model, strategy, {"data": 1}, 2.0, 2**20, forward_flops=4e12, tokens=4096,
                               device_type="cuda", forward_ops=400)
        step.profile = load_profile("h100_80gb")
        seconds[name] = step.seconds()
    assert seconds["none"] < seconds["selective"] < seconds["full"], seconds


def test_every_other_matmul_trains_exactly_like_no_checkpointing():
    """Recomputing every other matmul of each block in backward changes no number (fp32)."""
    plain = train_losses([], steps=3)
    every_other = train_losses([("checkpoint", {"selective": True, "keep_matmuls": "every_other"})], steps=3)
    assert '"keep_matmuls": "every_other"' in every_other["strategy"], every_other["strategy"]
    for got, want in zip(every_other["losses"], plain["losses"]):
        assert abs(got - want) <= 1e-6 * abs(want), (every_other["losses"], plain["losses"])


def test_keep_matmuls_needs_selective():
    from atorch.auto.strategy import Strategy
    from atorch.errors import AtorchConfigError

    with pytest.raises(AtorchConfigError, match="keep_matmuls='every_other' needs selective=True"):
        Strategy([("checkpoint", {"keep_matmuls": "every_other"})]).validate()


def test_every_other_matmul_is_costed_between_selective_and_full():
    """On a GPU profile: full recomputes every matmul, every_other those the probe counted
    (recomputed_flops), selective none."""
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.profiles import load_profile
    from atorch.auto.strategy import Strategy

    model = TinyTransformer()
    seconds = {}
    for name, config in (("full", {}), ("every_other", {"selective": True, "keep_matmuls": "every_other"}),
                         ("selective", {"selective": True})):
        strategy = resolve_strategy(model, Strategy([("checkpoint", config)]))
        recomputed = 1.5e12 if name == "every_other" else 0.0
        step = cost.build_cost(model, strategy, {"data": 1}, 2.0, 2**20, forward_flops=4e12, tokens=4096,
                               device_type="cuda", forward_ops=400, recomputed_flops=recomputed)
        step.profile = load_profile("h100_80gb")
        seconds[name] = step.seconds()
    assert seconds["selective"] < seconds["every_other"] < seconds["full"], seconds
