"""The cost model against measurements, and its pieces."""

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.search.cost import (
    ESTIMATE_RATIO,
    build_cost,
    candidate_ratio,
    estimate_memory,
    optimizer_state_factor,
    parse_bytes,
    surely_fits,
)
from tests.helpers.dist import run_distributed


def test_optimizer_state_factor():
    assert optimizer_state_factor(torch.optim.AdamW, {"lr": 1e-3}) == pytest.approx(2.0)
    assert optimizer_state_factor(torch.optim.SGD, {"lr": 0.1}) == 0.0
    assert optimizer_state_factor(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) == pytest.approx(1.0)


def test_parse_bytes():
    assert parse_bytes("70GiB") == 70 * 2**30 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1024) == 1024 and parse_bytes(None) is None
    with pytest.raises(ValueError, match="70GiB"):
        parse_bytes("lots")


def test_sharding_divides_what_it_shards():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    plain = estimate_memory(model, Strategy(), 4, 2.0, 0)
    fsdp = estimate_memory(model, Strategy([("fsdp", {"atorch_wrap_cls": ["Linear"]})]), 4, 2.0, 0)
    zero1 = estimate_memory(model, Strategy(["zero1"]), 4, 2.0, 0)
    # ZeroRedundancyOptimizer gives whole tensors to ranks: with 2 weights over 4 ranks, some
    # rank holds the state of a full 64x64 weight (benchmarks/scale.py shows it at 512 ranks).
    assert zero1.params == plain.params and zero1.optim_state == 2.0 * 64 * 64 * 4 > plain.optim_state / 4
    many = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])
    assert estimate_memory(many, Strategy(["zero1"]), 4, 2.0, 0).optim_state == 2.0 * 8 * 64 * 64 * 4 / 4
    assert fsdp.params == pytest.approx(plain.params / 4, abs=1) and fsdp.grads == pytest.approx(plain.grads / 4, abs=1)
    assert fsdp.gathered == 2 * (64 * 64 + 64) * 4


def test_zero2_on_fsdp2_counts_shards_whole_units_and_their_gradients():
    # FSDP2 (reshard_after_forward=False) holds each shard and every unit whole from its forward on;
    # a unit's gradients are whole until its reduce-scatter. The default bucket makes this toy one unit.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    whole = 2 * (64 * 64 + 64) * 4
    zero2 = estimate_memory(model, Strategy(["zero2"]), 2, 2.0, 0)
    assert zero2.params == whole / 2 + whole and zero2.gathered == whole and zero2.grads == whole / 2
    amp = estimate_memory(model, Strategy([("amp_native", "bf16"), "zero2"]), 2, 2.0, 0)
    assert amp.params == whole / 2 + whole / 2 and amp.gathered == whole / 2  # gathered in bf16
    # at the unit's reduce-scatter its bf16 gradients and their fp32 copy exist at once, with
    # the activations mostly gone: a moment of its own, which no activations change
    assert zero2.reduce_temp == 0 and amp.reduce_temp == whole / 2 + whole
    assert amp.total == amp.params + amp.optim_state + amp.grads + amp.reduce_temp
    # DeepSpeed's ZeRO-2 keeps whole parameters and no units
    ds = estimate_memory(model, Strategy([("zero2", {"use_ds_zero": True})]), 2, 2.0, 0)
    assert ds.params == whole and ds.gathered == 0


def test_fsdp_counts_whole_unit_gradients_in_backward_only():
    from atorch.auto.search.cost import build_cost

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    unit = 2 * (64 * 64 + 64) * 4  # no wrap class: the largest unit is the whole model
    # two moments: the end of forward (no gradient yet) and one in backward (half the gradients)
    profile = ((1.0, 0.0, 1.0), (0.8, 0.5, 1.0))
    forward = build_cost(model, Strategy(["fsdp"]), {"data": 2}, 2.0, activations=2 * unit,
                         activation_profile=profile[:1]).memory()
    backward = build_cost(model, Strategy(["fsdp"]), {"data": 2}, 2.0, activations=2 * unit,
                          activation_profile=profile).memory()
    assert forward.backward_grads == 0 and forward.activations == 2 * unit
    # in backward: 0.8 of the activations and, the model being one unit, the half of its
    # gradients backward has made, all still whole (none reduced to this rank's shard yet)
    assert backward.activations == pytest.approx(1.6 * unit, abs=1) and backward.backward_grads == unit // 2
    assert backward.total > forward.total
    # eight units of one Linear each: half the gradients made, two units of them whole (the one
    # running and the one being reduced), the rest reduced to this rank's half
    many = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    layer = (64 * 64 + 64) * 4
    units = build_cost(many, Strategy([("fsdp", {"atorch_wrap_cls": ["Linear"]})]), {"data": 2}, 2.0,
                       activations=2 * unit, activation_profile=profile).memory()
    assert units.backward_grads == (4 * layer - 2 * layer) / 2 + 2 * layer


def test_zero2_holds_its_gather_buffer_in_forward_and_whole_gradients_in_backward():
    # FSDP2 under zero2 keeps the all-gather's output through forward and frees it at forward's
    # end; in backward a unit's gradients are whole until its reduce-scatter (the cost-model
    # benchmark's Llama, one unit: checkpoint + zero2 was 1.14 of its measured peak without this)
    from atorch.auto.search.cost import build_cost

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    whole = 2 * (64 * 64 + 64) * 4
    forward_end, late_backward = (1.0, 0.0, 1.0), (0.3, 0.75, 1.0)
    at_forward = build_cost(model, Strategy(["zero2"]), {"data": 2}, 2.0, activations=4 * whole,
                            activation_profile=(forward_end,)).memory()
    at_backward = build_cost(model, Strategy(["zero2"]), {"data": 2}, 2.0, activations=4 * whole,
                             activation_profile=(late_backward,)).memory()
    assert at_forward.gathered == whole and at_forward.backward_grads == 0
    assert at_backward.gathered == 0 and at_backward.backward_grads == 0.75 * whole
    both = build_cost(model, Strategy(["zero2"]), {"data": 2}, 2.0, activations=4 * whole,
                      activation_profile=(forward_end, late_backward)).memory()
    assert both.total == max(at_forward.total, at_backward.total) == at_forward.total


def _ratios():
    from atorch.auto.search import measure
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    strategies = [[], [("amp_native", "bf16")], ["checkpoint"], ["zero1"], ["zero2"], ["fsdp"], ["checkpoint", "fsdp"]]
    report = measure(TinyTransformer(), strategies, torch.optim.AdamW, TokenDataset(), lm_loss,
                     optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                     timed_steps=1)
    return {" + ".join(c.names): c.estimated_peak_bytes / c.measured_peak_bytes for c in report.candidates}


def test_estimates_are_close_to_measured_peaks_on_2_ranks():
    ratios = run_distributed(_ratios, 2)[0]
    assert len(ratios) == 7
    # The benchmark (benchmarks/cost_model.py) tracks the 10% goal; the test catches regressions.
    assert all(0.8 <= r <= 1.25 for r in ratios.values()), ratios
    # fsdp's backward holds the unsharded gradients of the unit it runs and of the one it reduces:
    # without them fsdp estimated 0.89 of its peak here (1.09 with), checkpoint + fsdp 0.92 (1.05)
    # and on search_quality's small Llama (4 ranks) 0.82 (1.00)
    assert ratios["parallel_mode + fsdp"] >= 0.9 and ratios["parallel_mode + checkpoint + fsdp"] >= 0.9, ratios


def _amp_ratios(device: str) -> tuple[float, float]:
    """activations under amp_native bf16 / without it, plain and with checkpointing."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search.cost import activation_bytes
    from tests.helpers.models import SEQ, TinyTransformer

    ctx = DeviceContext(1, 1, torch.device("cpu"), None, 2**30)
    with torch.device(device):
        torch.manual_seed(0)
        model = TinyTransformer()
        ids = torch.zeros(16, SEQ, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}

    def saved(methods):
        return activation_bytes(model, resolve_strategy(model, Strategy(methods)), batch, "unpack_dict", None, ctx)

    amp = ("amp_native", "bf16")
    return saved([amp]) / saved([]), saved([amp, "checkpoint"]) / saved(["checkpoint"])


def test_a_plan_counts_amp_native_activations_in_autocasts_dtypes():
    """On meta tensors (a plan) autocast does nothing; amp_native emulates its casts there
    (atorch/amp/meta_autocast.py, CUDA's op lists), so what stays fp32 under autocast (the norms,
    softmax, the loss) is counted at 4 bytes: more than half the fp32 bytes, less than all. The
    old term counted every byte at bf16's width (0.5 exactly: a 1.1B Llama's bf16 step then
    measured 1.2x its estimate on an H200)."""
    meta = _amp_ratios("meta")
    assert all(0.6 < ratio < 0.9 for ratio in meta), meta
    # on real tensors the probe runs CPU autocast, whose lists keep fewer ops in fp32
    real = _amp_ratios("cpu")
    assert all(0.5 < ratio < m for m, ratio in zip(meta, real)), (meta, real)


def test_a_cast_weight_keeps_its_address_until_the_count_ends():
    """Autocast drops its cached weight casts when it exits, before the loss runs; a cast freed
    then could lend its storage address to the loss's 4-byte total weight, which would count as a
    weight in one run and as saved in the next (two ranks' probes disagreed by 4 bytes)."""
    from atorch.auto.search import cost

    weight = torch.nn.Parameter(torch.randn(8, 8))
    counter = cost._SavedBytes([weight])
    with counter.casts():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.linear(torch.randn(2, 8), weight)
        fresh = [torch.ones(4) for _ in range(200)]
        assert not {cost._storage_key(t) for t in fresh} & counter.weights


def test_checkpoint_candidates_are_trusted_to_fit_only_within_their_measured_error():
    # Checkpoint estimates run as low as 0.69 of the measured peak on the Llama workloads
    # (docs/benchmarks.md): an estimate of 70 against a budget of 100 fits by the search's usual
    # bounds (70 / 0.8 = 87.5) but may measure over 100, so it must not count as surely fitting.
    from tests.helpers.models import TinyTransformer

    model = TinyTransformer()
    plain = build_cost(model, Strategy(), {"data": 2}, 2.0, 0)
    checkpointed = build_cost(model, Strategy(["checkpoint"]), {"data": 2}, 2.0, 0)
    assert candidate_ratio(ESTIMATE_RATIO, plain) == ESTIMATE_RATIO
    low, high = candidate_ratio(ESTIMATE_RATIO, checkpointed)
    assert low <= 0.69 and high == ESTIMATE_RATIO[1]
    assert surely_fits(70, 100, ESTIMATE_RATIO) and not surely_fits(70, 100, (low, high))


def test_a_checkpointed_peak_counts_the_gradients_alive_beside_the_activations():
    # Without checkpointing the activation peak is at the end of forward (no gradients yet); with
    # it, late in backward, where the gradients exist too.
    from tests.helpers.models import TinyTransformer

    model, activations = TinyTransformer(), 10**6
    plain = build_cost(model, Strategy(), {"data": 2}, 2.0, activations).memory()
    checkpointed = build_cost(model, Strategy(["checkpoint"]), {"data": 2}, 2.0, activations).memory()
    assert plain.backward_grads == 0 and checkpointed.backward_grads == checkpointed.grads > 0
    states = checkpointed.params + checkpointed.optim_state + checkpointed.gathered
    assert checkpointed.total == states + activations + checkpointed.grads
    assert plain.total == states + activations
