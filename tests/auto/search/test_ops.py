"""ops.OpCounter counts FLOPs as torch's FlopCounterMode does (with the CPU's fused attention
kernel added to its table), without FlopCounterMode's per-module bookkeeping: the same total and
the same attention share, on the models a search probes."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from atorch.auto.search import ops
from atorch.methods.checkpoint import CheckpointedForward
from tests.helpers.hf import VOCAB, tiny_llama


def _torch_counts(run) -> tuple[int, int, int]:
    """torch's FlopCounterMode (the CPU kernel mapped as ops maps it) around the operator count."""
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flops = FlopCounterMode(display=False, custom_mapping={cpu_flash: ops._cpu_flash_attention_flops})
    with flops, ops.OpCounter() as counted:
        run()
    by_op = flops.get_flop_counts()["Global"]
    attention = sum(n for op, n in by_op.items() if "scaled_dot_product" in str(op))
    return flops.get_total_flops(), attention, counted.count


def _counts(run) -> tuple[int, int, int]:
    with ops.OpCounter() as counted:
        run()
    return counted.flops, counted.attention_flops, counted.count


def _llama(checkpointed: bool):
    model = tiny_llama()
    if checkpointed:
        for layer in model.model.layers:
            layer.forward = CheckpointedForward(layer.forward, use_reentrant=False)
    return model


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_llamas_step_counts_as_torchs_flop_counter(amp, checkpointed):
    model = _llama(checkpointed)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # a checkpointed block's forward again, under the counter

    mine, theirs = _counts(run), _torch_counts(run)
    assert mine == theirs
    flops, attention, count = mine
    assert 0 < attention < flops and count > 0  # the CPU's attention kernel is counted


def test_an_mlps_forward_and_backward_count_as_torchs_flop_counter():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(4, 16)

    def run():
        model(x).square().mean().backward()

    assert _counts(run) == _torch_counts(run)
    # two matmuls forward; backward: the second layer's input and weight gradients, the first's
    # weight gradient (x needs none); each 2 x 4 x 16 x 64
    assert _counts(run)[0] == 5 * 2 * 4 * 16 * 64


def test_a_fused_moes_expert_flops_count_on_a_real_device_as_at_their_expected_load_on_meta():
    """transformers' fused experts run torch's grouped matmul, which torch's table leaves out: a
    probe of a real Mixtral counted none of its experts' FLOPs (a quarter of this one's forward,
    most of a real one's; until 2026-11-29). Every (token, choice) pair runs one expert however
    the router spreads them, so the count equals the meta probe's expected load exactly."""
    pytest.importorskip("transformers")
    from atorch.parallel_layers.experts import expected_load
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ops.OpCounter(count_traffic=False) as real:
        tiny_moe("mixtral")(input_ids=ids)
    with torch.device("meta"):
        meta = tiny_moe("mixtral")
    with torch.no_grad(), expected_load(meta), ops.OpCounter(count_traffic=False) as expected:
        meta(input_ids=ids.to("meta"))
    assert real.flops == expected.flops > 0
    experts = sum(p.numel() for name, p in meta.named_parameters() if ".experts." in name)
    assert real.flops > 2 * ids.numel() * 2 * experts / 4  # the pairs' expert FLOPs: 2 choices of 4 experts


class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


FUSED = {  # models whose real-device forward runs a fused kernel torch's FLOP table leaves out
    "lstm": (lambda: torch.nn.LSTM(32, 64, num_layers=2), (16, 4, 32)),  # mkldnn_rnn_layer
    "bidirectional lstm": (lambda: torch.nn.LSTM(32, 64, num_layers=2, bidirectional=True, batch_first=True),
                           (4, 16, 32)),
    # frozen, in eval mode: torch's fast paths (_transformer_encoder_layer_fwd, _native_multi_head_attention)
    "frozen encoder": (lambda: torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
                                                           2, enable_nested_tensor=False), (2, 32, 64)),
    "frozen attention": (_SelfAttention, (2, 32, 64)),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_a_fused_kernels_flops_count_on_a_real_device_as_its_matmuls_do_on_meta(name):
    """On meta tensors these layers decompose into matmuls, which torch's table counts; on a CPU
    they run one fused kernel each, which it does not: a 2-layer LSTM language model's probe had
    counted only its head, a frozen encoder none (until 2026-11-29)."""
    build, shape = FUSED[name]
    counts = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model = build().eval().requires_grad_(False)
        with torch.no_grad(), ops.OpCounter(count_traffic=False) as counted:
            model(torch.randn(shape).to(device))
        counts[device] = counted.flops
    assert counts["cpu"] == counts["meta"] > 0, counts


def test_a_matrix_vector_product_and_a_bilinear_layer_count_their_multiply_adds():
    with ops.OpCounter(count_traffic=False) as counted:
        torch.randn(8, 16, 32) @ torch.randn(32)
    assert counted.flops == 2 * 8 * 16 * 32
    with torch.no_grad(), ops.OpCounter(count_traffic=False) as counted:
        torch.nn.Bilinear(8, 6, 5)(torch.randn(4, 8), torch.randn(4, 6))  # aten._trilinear: 0 before
    assert counted.flops == 2 * 4 * 5 * 8 * 6


def test_a_moe_blocks_expert_loop_moves_the_rows_it_routes_not_the_whole_batch_each_time():
    """transformers' eager experts gather each expert's tokens (``x[index]``) and add its output
    back (``index_add_``) expert by expert: each reads and writes the rows it routes. Counted as
    whole tensors, 60 experts' loop moved 3.0x the bytes the grouped-matmul path moves for the
    same routing (until 2026-11-29); now 1.21x, the loop's own buffers, one-hot mask and searches."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=60, num_experts_per_tok=4)).train()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    weights = {ops._key(t) for t in (*model.parameters(), *model.buffers())}
    moved = {}
    for implementation in ("grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        with torch.no_grad(), ops.OpCounter(weights) as counted:
            model(input_ids=ids)
        moved[implementation] = counted.traffic
    assert moved["grouped_mm"] < moved["eager"] < 1.3 * moved["grouped_mm"], moved


def test_a_frozen_encoder_over_padded_sequences_counts_the_tokens_it_runs():
    """With a padding mask the fast path runs a nested tensor of the real lengths (reading its
    shape had raised): the FLOPs are those of each sequence alone."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2).eval().requires_grad_(False)
    x = torch.randn(2, 32, 64)
    padding = torch.zeros(2, 32, dtype=torch.bool)
    padding[1, 16:] = True

    def flops(*args, **kwargs) -> int:
        with torch.no_grad(), ops.OpCounter(count_traffic=False) as counted:
            encoder(*args, **kwargs)
        return counted.flops

    assert flops(x, src_key_padding_mask=padding) == flops(x[:1]) + flops(x[1:, :16]) > 0
