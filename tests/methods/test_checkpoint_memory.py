"""What checkpointing is for, asserted directly: a checkpointed step's measured peak is lower than
the plain one's, and the cost model's checkpointed activation estimate is the plain estimate less
what each block beyond one no longer keeps."""

import contextlib

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.auto.environment import DeviceContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.search import cost
from atorch.auto.search.attention import FlashAttentionProbe
from atorch.auto.search.peak import PeakMemory
from atorch.auto.strategy import Strategy
from tests.helpers.models import DIM, SEQ, TinyTransformer, TokenDataset, lm_loss

BATCH = 16


def _measured_peak(methods, layers: int = 4) -> int:
    torch.manual_seed(0)
    _, result, _ = auto_accelerate(TinyTransformer(layers), load_strategy=methods)
    data = TokenDataset()
    batch = {k: torch.stack([data[i][k] for i in range(BATCH)]) for k in ("input_ids", "labels")}
    with PeakMemory(result.model) as tracker:
        lm_loss(batch, result.model(batch["input_ids"])).backward()
    assert not tracker.failed
    return tracker.peak


def test_a_checkpointed_step_peaks_lower_than_the_plain_one():
    """Measured on 4 blocks: 1,400,584 B plain, 746,504 B checkpointed (0.53; parameters 219,904 B).
    (Negative control: apply_checkpoint leaving each block's forward as it is fails this.)"""
    plain, checkpointed = _measured_peak([]), _measured_peak(["checkpoint"])
    assert checkpointed <= 0.6 * plain, (checkpointed, plain)


def _estimated(methods, layers: int) -> int:
    """The plan's activation bytes (meta tensors, as `atorch plan` probes them)."""
    with torch.device("meta"):
        model = TinyTransformer(layers)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    device = DeviceContext(1, 1, torch.device("cpu"), None, 2**30)
    return cost.activation_bytes(model, resolve_strategy(model, Strategy(methods)), {"input_ids": ids, "labels": ids},
                                 "unpack_dict", None, device)


def test_the_checkpointed_activation_estimate_keeps_block_inputs_and_one_recomputed_block():
    """Checkpointed, each block keeps only its input (batch x seq x dim fp32) through forward, and
    one block's activations exist again while it is recomputed in backward: estimate(L) = plain(L)
    - (L - 1) x (block - input), exactly (the band is 0 bytes). Per block: 313,344 B plain, 16,384 B
    checkpointed. (Negative controls: dropping the recomputed block from cost.activation_bytes, or
    probing without the checkpoint applied, fails this.)"""
    block_input = BATCH * SEQ * DIM * 4
    plain = {layers: _estimated([], layers) for layers in (2, 4)}
    checkpointed = {layers: _estimated(["checkpoint"], layers) for layers in (2, 4)}
    block = (plain[4] - plain[2]) // 2
    assert block > 10 * block_input, (block, block_input)
    assert checkpointed[4] - checkpointed[2] == 2 * block_input, checkpointed
    for layers in (2, 4):
        assert checkpointed[layers] == plain[layers] - (layers - 1) * (block - block_input), (layers, checkpointed, plain)


@pytest.mark.parametrize("selective", [False, True])
def test_checkpointing_leaves_the_forwards_flops_as_they_are_on_meta_and_on_real_tensors(selective):
    # Its recompute is the cost term's (an extra pass, or the element-wise operators again): the
    # probe's forward FLOPs are the plain forward's. On meta tensors the counter saw a selective
    # checkpoint's matmuls twice (issue 54: 124.8 TFLOP for a 7B step whose forward does 62.9),
    # which ranked selective checkpointing 30% slower than full and kept it out of every plan.
    from tests.helpers.hf import CountingTokens, tiny_llama

    data = CountingTokens()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    device_ctx = DeviceContext(1, 1, torch.device("cpu"), None, 2**40)
    checkpoint = ("checkpoint", {"selective": True}) if selective else "checkpoint"
    for device in ("meta", "cpu"):
        flops = {}
        for name, methods in (("plain", []), ("checkpointed", [checkpoint])):
            with torch.device(device):
                model = tiny_llama()
            probe = {k: v.to(device) for k, v in batch.items()}
            counts: list = []
            loss = None if device == "meta" else (lambda b, out: out.loss)
            cost.activation_bytes(model, resolve_strategy(model, Strategy(methods)), probe, "unpack_dict", loss,
                                  device_ctx, counts)
            flops[name] = counts[0]
        assert flops["checkpointed"] == pytest.approx(flops["plain"], rel=1e-9), (device, flops)


def _backward_flops(model, batch, config: dict | None) -> tuple[float, float]:
    """FLOPs the step's backward runs (the recompute in it), and of them attention's, counted as
    the operators run."""
    from atorch.auto.search.ops import OpCounter

    _, result, _ = auto_accelerate(model, load_strategy=[] if config is None else [("checkpoint", config)])
    loss = result.model(**batch).loss
    with OpCounter() as counter:
        loss.backward()
    return counter.flops, counter.attention_flops


@pytest.mark.parametrize("config", [{"selective": True, "keep_matmuls": "every_other"}, {}, {"no_reentrant": False}],
                         ids=["every other matmul", "full", "full, reentrant"])
def test_the_probe_counts_the_flops_a_checkpoints_recompute_runs(config):
    """keep_matmuls="every_other" recomputes the 2nd, 4th... matmul of each block; full
    checkpointing recomputes the block's forward up to its last saved tensor (torch's
    non-reentrant checkpoint stops there: a Llama block's down projection is not run again), the
    reentrant one all of it. The probe counts those FLOPs (every_other from its policy, on meta
    and real tensors; full by running each block once more, on meta: the plan's probe), and they
    equal what the backward runs beyond a plain one's, counted on CPU. Full checkpointing was
    charged a whole forward again: 1.44x what a tiny Llama's recomputes."""
    from tests.helpers.hf import CountingTokens, tiny_llama

    data = CountingTokens()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    plain = _backward_flops(tiny_llama(), batch, None)
    checkpointed = _backward_flops(tiny_llama(), batch, config)
    extra = (checkpointed[0] - plain[0], checkpointed[1] - plain[1])
    assert extra[0] > 0
    assert _backward_flops(tiny_llama(), batch, {"selective": True}) == plain  # keeps every matmul
    device_ctx = DeviceContext(1, 1, torch.device("cpu"), None, 2**40)
    for device in ("meta", "cpu"):
        with torch.device(device):
            model = tiny_llama()
        counts: list = []
        # on meta as the plan probes (torch's flash kernel, which has meta rules; the CPU's own ran)
        with FlashAttentionProbe() if device == "meta" else contextlib.nullcontext():
            cost.activation_bytes(model, resolve_strategy(model, Strategy([("checkpoint", config)])),
                                  {k: v.to(device) for k, v in batch.items()}, "unpack_dict",
                                  None if device == "meta" else (lambda b, out: out.loss), device_ctx, counts)
        assert (counts[8], counts[9]) == extra, (device, counts[8:], extra)


def test_every_other_matmul_keeps_less_than_selective_and_more_than_full():
    """Measured peaks of one step on CPU: every other matmul's output recomputed, the rest kept."""
    peaks = {name: _measured_peak(methods) for name, methods in (
        ("full", ["checkpoint"]), ("every_other", [("checkpoint", {"selective": True, "keep_matmuls": "every_other"})]),
        ("selective", [("checkpoint", {"selective": True})]))}
    assert peaks["full"] < peaks["every_other"] < peaks["selective"], peaks


def test_counting_a_recompute_on_real_tensors_leaves_the_real_forward_as_it_was():
    """The search's probe on a CPU counts a full checkpoint's recompute by running the block on fake
    tensors made from the real ones. Under autocast, the cast of a real weight made there must not
    stay in autocast's cache for the real forward that follows (it would get a fake weight), and
    the probe's own dispatch modes must not see it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from atorch.methods.checkpoint import full_recompute_flops

    class Seen(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = block(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), Seen():
        flops, _ = full_recompute_flops(block.forward, (x,), {}, False)
        assert Seen.ops == 0
        out = block(x)
    assert flops == 2 * 4 * 16 * 32 * 2
    assert type(out) is torch.Tensor and torch.equal(out, expected)


def test_a_block_fake_tensors_cannot_run_is_charged_a_whole_forward_not_refused():
    """Mixtral's grouped expert matmuls have no fake-tensor rule for fp32 on a CPU: the recompute
    of its checkpointed blocks cannot be counted, so none is reported (the cost charges a whole
    forward again, as before the count), and the probe goes on."""
    pytest.importorskip("transformers")
    from tests.helpers.hf import CountingTokens
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    data = CountingTokens()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    model = tiny_moe("mixtral")
    counts: list = []
    cost.activation_bytes(model, resolve_strategy(model, Strategy([("checkpoint", {})])), batch, "unpack_dict",
                          lambda b, out: out.loss, DeviceContext(1, 1, torch.device("cpu"), None, 2**40), counts)
    assert counts[8:10] == [0, 0] and counts[0] > 0
