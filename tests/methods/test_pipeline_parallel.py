"""pipeline_parallel through auto_accelerate on a tiny Llama, against the single-process run."""

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.environment import DeviceContext
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed
from tests.pipeline.models import serial_losses, train_chain, train_pipelined

PP2 = ("parallel_mode", ([("pipeline", 2)], None))


def _schedules():
    return {
        "1f1b": train_pipelined([PP2, ("pipeline_parallel", {"num_microbatches": 4})]),
        "interleaved": train_pipelined([PP2, ("pipeline_parallel", {
            "num_microbatches": 2, "schedule": "interleaved", "virtual_pipeline_size": 2,
            "pipeline_cuts": ["model.embed_tokens", "model.layers.0", "model.layers.1"]})]),
        # a loaded pipeline strategy dry-run by the search before it is applied
        "dry_run": train_chain([PP2, ("pipeline_parallel", {"num_microbatches": 2})],
                               ignore_dryrun_on_load_strategy=False),
    }


def test_llama_pipeline2_matches_single_process():
    pytest.importorskip("transformers")
    from tests.helpers.hf import tiny_llama, train_hf

    reference = train_hf([])
    results = run_distributed(_schedules, 2)
    total = sum(p.numel() for p in tiny_llama().parameters())
    for name, schedule_class in (("1f1b", "Schedule1F1B"), ("interleaved", "ScheduleInterleaved1F1B")):
        first, last = (r[name] for r in results)
        assert first["schedule_class"] == last["schedule_class"] == schedule_class, (name, first["schedule_class"])
        assert first["losses"] == last["losses"]
        assert_losses_close(first["losses"], reference["losses"], FP32_RTOL)
        # the optimizer holds only the local stage's parameters
        assert first["optim_numel"] + last["optim_numel"] == total
    for result in results:
        assert_losses_close(result["dry_run"]["losses"], serial_losses(), FP32_RTOL)
    strategy = Strategy.from_json(results[0]["1f1b"]["strategy"])
    assert strategy.opt_names == ["parallel_mode", "pipeline_parallel"]


def test_without_a_pipeline_dim_one_is_chosen_and_conflicts_raise():
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import plan_strategy
    from atorch.errors import StrategyConflictError, WorldSizeError

    device = DeviceContext(2, 2, torch.device("cpu"), None, 2**30)
    strategy, notes = plan_strategy(Strategy(["parallel_mode", "pipeline_parallel"]), device)
    assert strategy.opt_names == ["parallel_mode", "pipeline_parallel"]
    assert strategy.get("parallel_mode").dims == [("pipeline", 2), ("data", 1)]
    assert any("no 'pipeline' dim; chose pipeline=2" in n and n.warning for n in notes)
    with pytest.raises(WorldSizeError, match="need a multiple of 3 processes but the world size is 2"):
        plan_strategy(Strategy([("parallel_mode", ([("pipeline", 3)], None)), "pipeline_parallel"]), device)
    four = DeviceContext(4, 4, torch.device("cpu"), None, 2**30)
    with pytest.raises(StrategyConflictError, match="'zero2' and 'pipeline_parallel'.*fairscale wraps the whole model"):
        plan_strategy(Strategy([PP2, "pipeline_parallel", ("zero2", {"not_use_fsdp": True})]), four)
    # fsdp shards each stage over its data ranks (tests/methods/test_pipeline_fsdp.py)
    assert "fsdp" in plan_strategy(Strategy([PP2, "pipeline_parallel", "fsdp"]), four)[0]


def test_configs_and_models_it_cannot_run_raise():
    from atorch.auto.plan import resolve_strategy
    from atorch.errors import MethodConfigError, NotSupportedError

    with pytest.raises(MethodConfigError, match="gpipe' runs one stage per rank"):
        resolve_strategy(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                         Strategy([("pipeline_parallel", {"schedule": "gpipe", "virtual_pipeline_size": 2})]))
    with pytest.raises(NotSupportedError, match="does not know how Linear's forward flows"):
        resolve_strategy(torch.nn.Linear(2, 2), Strategy(["pipeline_parallel"]))
    with pytest.raises(MethodConfigError, match="num_microbatches"):
        Strategy([("pipeline_parallel", {"num_microbatches": 0})])


def test_decoder_layout_refuses_inputs_it_would_drop():
    pytest.importorskip("transformers")
    from atorch.errors import NotSupportedError
    from atorch.pipeline.layouts import DecoderLMLayout, layout_for
    from tests.helpers.hf import tiny_llama

    layout = layout_for(tiny_llama())
    assert isinstance(layout, DecoderLMLayout) and layout.units[0] == "model.embed_tokens"
    assert layout.units[-2:] == ["model.norm", "lm_head"]
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4), "labels": None}
    layout.check_kwargs(list(layout.prepare_batch(batch)))  # the mask is handed between stages
    with pytest.raises(NotSupportedError, match=r"\['position_ids'\] are not passed between stages"):
        layout.check_kwargs(["input_ids", "attention_mask", "position_ids"])
    layout.route_mask = False  # DeepSpeed's engine: one tensor between stages
    batch["attention_mask"][0, 3] = 0
    with pytest.raises(NotSupportedError, match="a padding attention_mask .* needs pipeline_parallel"):
        layout.check_kwargs(list(layout.prepare_batch(batch)))


PP2_DATA2 = ("parallel_mode", ([("pipeline", 2), ("data", 2)], None))


def _pipeline_with_zero1() -> dict:
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens, tiny_llama
    from tests.helpers.models import optimizer_state_numel, result_steps

    out = {}
    for name, extra in (("plain", []), ("zero1", ["zero1"])):
        _, result, strategy = auto_accelerate(
            tiny_llama(), torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss, optim_args={"lr": 1e-2},
            dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
            load_strategy=[PP2_DATA2, ("pipeline_parallel", {"num_microbatches": 2}), *extra])
        out[name] = {"losses": result_steps(result, 5), "state_numel": optimizer_state_numel(result.optim), "optimizer": type(result.optim).__name__,
                     "methods": strategy.opt_names}
    return out


def test_a_pipeline_with_zero1_shards_each_stages_optimizer_state_and_matches_serial():
    """pipeline=2 x data=2 + zero1 on 4 ranks: the loss of every step equals the single-process
    run's (AdamW, fp32), and each data rank of a stage keeps about half of its optimizer state."""
    pytest.importorskip("transformers")
    from tests.helpers.hf import train_hf

    reference = train_hf([])
    results = run_distributed(_pipeline_with_zero1, 4, timeout_s=400)
    for rank in results:
        assert rank["zero1"]["methods"] == ["parallel_mode", "pipeline_parallel", "zero1"]
        assert rank["zero1"]["optimizer"] == "ZeroRedundancyOptimizer"
        assert_losses_close(rank["zero1"]["losses"], reference["losses"], FP32_RTOL)
        assert 0.3 < rank["zero1"]["state_numel"] / rank["plain"]["state_numel"] < 0.7


def test_the_short_form_takes_as_many_microbatches_as_stages_and_a_given_count_stays():
    """`pipeline_parallel` with no config derives what it needs once the pipeline dim is known:
    one microbatch per stage (a single one left every stage but one idle); a count the user wrote
    is kept, and mixed_parallel's short form does the same."""
    from atorch.auto.plan import plan_strategy
    from atorch.auto.strategy import parse_strategy

    ranks = DeviceContext(4, 4, torch.device("cpu"), None, 2**34)
    for written, microbatches in ((["parallel_mode", "pipeline_parallel"], 2),
                                  (["parallel_mode", ("pipeline_parallel", {"num_microbatches": 1})], 1),
                                  ([("parallel_mode", {"dims": [["pipeline", 4]]}), "pipeline_parallel"], 4),
                                  (["parallel_mode", "mixed_parallel"], 2)):
        strategy, _ = plan_strategy(parse_strategy(written), ranks)
        layout = dict(strategy.items())["mixed_parallel" if "mixed_parallel" in strategy else "pipeline_parallel"]
        assert layout.num_microbatches == microbatches, written


class _Vectors(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index: int) -> dict:
        return {"input": torch.randn(32, generator=torch.Generator().manual_seed(index))}


def _linears(relu: bool = False) -> torch.nn.Sequential:
    """4 Linears as the pipeline's units, or (``relu``) 4 units of a Linear and a ReLU."""
    torch.manual_seed(0)
    if relu:
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(4)))
    return torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))


def _units(kind: str) -> torch.nn.Module:
    from tests.helpers.models import TinyTransformer

    torch.manual_seed(0)
    return TinyTransformer() if kind == "blocks" else _linears(relu=kind == "linear relu")


def _sends(methods: list, kind: str) -> tuple[int, int]:
    from tests.helpers.comms import step_traffic
    from tests.helpers.models import TokenDataset, lm_loss

    if kind == "blocks":
        seen = step_traffic(_units(kind), methods, TokenDataset(), 8, loss_func=lm_loss)
    else:
        seen = step_traffic(_units(kind), methods, _Vectors(), 8, loss_func=lambda batch, out: out.float().pow(2).mean())
    return seen["other"]["send_recv"]  # the pipeline's group is the world's


@pytest.mark.parametrize("kind", ["linears", "linear relu", "blocks"])
@pytest.mark.parametrize("amp", [False, True])
def test_the_sends_are_charged_in_the_dtype_the_stages_hand_on(amp, kind):
    """Stages of Linears (or of Linear-and-ReLU units) hand on a matmul's output: bf16 under
    autocast, half the bytes of fp32. Stages of blocks hand on their residual stream, which
    autocast leaves in fp32 (as a decoder's: tests/methods/test_mixed_parallel_virtual.py).
    Counted on 2 gloo ranks. Until 2026-11-29 every stage's sends were charged in the weights'
    dtype: twice the bytes of the Linears' under amp."""
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search.cost import build_cost
    from tests.helpers.models import SEQ

    blocks = kind == "blocks"
    methods = [PP2, ("pipeline_parallel", {"num_microbatches": 2}), *([("amp_native", "bf16")] if amp else [])]
    counted = run_distributed(_sends, 2, methods, kind)
    model = _units(kind)
    tokens = 8 * SEQ if blocks else 8
    cost = build_cost(model, resolve_strategy(model, Strategy(methods)), {"pipeline": 2}, 2.0, 0, 1e9, tokens)
    charged = [(c.messages, c.elements * cost.comm_element_bytes(c)) for c in cost.comms if c.kind == "send_recv"]
    assert charged == [counted[0]] and counted[0] == counted[1], (charged, counted)
    # 2 microbatches each way, each of half the batch's tokens, 32 features
    assert counted[0][1] == 4 * tokens // 2 * 32 * (2 if amp and not blocks else 4)
