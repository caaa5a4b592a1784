"""mixed_parallel with virtual stages (interleaved 1F1B over a tensor x pipeline grid) and with
zero1, against the single-process run; their memory estimates against the peaks the search's
PeakMemory measures, and their collectives against the cost model's terms.

4 gloo ranks (one spawn for every check): tensor=2 x pipeline=2 with 2 virtual stages a rank, and
tensor=2 x data=2 with zero1 (a 4-rank world leaves no data rank beside tensor=2 x pipeline=2).
The whole grid, tensor=2 x pipeline=2 x data=2 with virtual stages and zero1, on 8 ranks (slow).
"""

import pytest
import torch

from atorch.auto.environment import DeviceContext
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed
from tests.helpers.models import serial_steps

pytest.importorskip("transformers")

LAYERS, STEPS, BATCH = 4, 5, 8


def _llama(device: str = "cpu"):
    """The tiny Llama of tests/helpers/hf.py with 4 layers: 2 ranks x 2 virtual stages of one each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf import VOCAB

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device(device):
        return LlamaForCausalLM(config)


def _mixed(tensor: int, pipeline: int, virtual: int = 1, microbatches: int = 2):
    config = {"tensor_size": tensor, "pipeline_size": pipeline, "num_microbatches": microbatches}
    return ("mixed_parallel", {**config, **({"virtual_pipeline_size": virtual} if virtual > 1 else {})})


INTERLEAVED = [_mixed(2, 2, virtual=2)]
INTERLEAVED_AMP = [*INTERLEAVED, ("amp_native", {"dtype": "bf16"})]
# the same grid with sequence parallelism inside each stage
SEQUENCE = [("mixed_parallel", {**_mixed(2, 2, virtual=2)[1], "sequence_parallel": True})]
TENSOR_DATA_ZERO1 = [_mixed(2, 1, microbatches=1), "zero1"]
GRID_ZERO1 = [_mixed(2, 2, virtual=2), "zero1"]  # 8 ranks: tensor=2 x pipeline=2 x data=2


def _serial_losses(padded: bool = False) -> list[float]:
    from tests.helpers.hf import CountingTokens, PaddedTokens

    model, data = _llama(), PaddedTokens() if padded else CountingTokens()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = ({key: torch.stack([data[i][key] for i in range(step * BATCH, (step + 1) * BATCH)]) for key in data[0]}
               for step in range(STEPS))
    return serial_steps(model, optim, batches)


def _train(load_strategy, padded: bool = False) -> dict:
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens, PaddedTokens
    from tests.helpers.models import optimizer_state_numel, result_steps

    data = PaddedTokens() if padded else CountingTokens()
    _, result, strategy = auto_accelerate(
        _llama(), torch.optim.AdamW, data, lambda batch, out: out.loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict", load_strategy=load_strategy)
    losses = result_steps(result, STEPS)
    state = optimizer_state_numel(result.optim)
    local = sum(p.numel() for p in result.model.parameters() if p.requires_grad)
    kinds = {type(m).__name__ for _, m in result.model.local_named_modules() if "Parallel" in type(m).__name__}
    return {"losses": losses, "methods": strategy.opt_names, "optimizer": type(result.optim).__name__,
            "schedule": result.model.schedule_name, "local_stages": len(result.model.local_stage_ids),
            "state_share": state / (2 * local), "parallel_modules": sorted(kinds),
            "sequence_parts": [getattr(m, "sequence_parts", 1) for m in result.model.stage_modules]}


def _memory_ratios(cases: dict) -> dict:
    from atorch.auto.search import measure
    from tests.helpers.hf import CountingTokens

    report = measure(_llama(), list(cases.values()), torch.optim.AdamW, CountingTokens(),
                     lambda batch, out: out.loss, optim_args={"lr": 1e-3}, dataloader_args={"batch_size": BATCH},
                     model_input_format="unpack_dict", timed_steps=1)
    return {name: c.estimated_peak_bytes / c.measured_peak_bytes for name, c in zip(cases, report.candidates)}


def _traffic(load_strategy) -> dict:
    from tests.helpers.comms import step_traffic
    from tests.helpers.hf import CountingTokens

    return step_traffic(_llama(), load_strategy, CountingTokens(), BATCH)


PIPELINE4 = [("parallel_mode", ([("pipeline", 4), ("data", 1)], None)), ("pipeline_parallel", {"num_microbatches": 4})]


def _four_ranks() -> dict:
    return {"interleaved": _train(INTERLEAVED), "zero1": _train(TENSOR_DATA_ZERO1),
            "sequence": _train(SEQUENCE, padded=True),
            "memory": _memory_ratios({"interleaved": INTERLEAVED, "zero1": TENSOR_DATA_ZERO1, "sequence": SEQUENCE}),
            "traffic": _traffic(INTERLEAVED), "pipeline4": _traffic(PIPELINE4), "amp_traffic": _traffic(INTERLEAVED_AMP),
            "zero1_traffic": _traffic(TENSOR_DATA_ZERO1), "sequence_traffic": _traffic(SEQUENCE)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(_four_ranks, 4, timeout_s=600)


def test_interleaved_over_a_tensor_grid_trains_like_the_serial_model(four_ranks):
    """tensor=2 x pipeline=2, 2 virtual stages a rank (4 stages of one layer): each rank runs
    interleaved 1F1B over its 2 tensor-parallel stages; every step's loss is the serial run's."""
    reference = _serial_losses()
    for rank in four_ranks:
        run = rank["interleaved"]
        assert (run["schedule"], run["local_stages"]) == ("interleaved", 2)
        assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(run["parallel_modules"])
        assert_losses_close(run["losses"], reference, FP32_RTOL)


def test_sequence_parallelism_inside_the_grids_stages_trains_like_the_serial_model_on_padded_batches(four_ranks):
    """The same grid with sequence_parallel=True, on right-padded batches (attention mask and
    labels -100): the stage holding the first block splits the sequence, the later ones receive
    a tensor rank's chunk and build positions and the mask for the whole sequence; every step's
    loss is the serial run's token mean."""
    reference = _serial_losses(padded=True)
    for rank in four_ranks:
        run = rank["sequence"]
        assert (run["schedule"], run["local_stages"]) == ("interleaved", 2)
        assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(run["parallel_modules"])
        assert_losses_close(run["losses"], reference, FP32_RTOL)
    # stage 0 (pipeline rank 0's first) splits the sequence; stages 1-3 receive chunks of 2 parts
    assert sorted(part for rank in four_ranks for part in rank["sequence"]["sequence_parts"]) == [1, 1, 2, 2, 2, 2, 2, 2]


def test_zero1_shards_the_tensor_slices_state_over_the_data_ranks_and_trains_like_serial(four_ranks):
    """tensor=2 x data=2 + zero1: ZeroRedundancyOptimizer over the data ranks that hold the same
    tensor slices; each keeps about half of its slices' AdamW state."""
    reference = _serial_losses()
    for rank in four_ranks:
        run = rank["zero1"]
        assert run["methods"] == ["parallel_mode", "mixed_parallel", "zero1"]
        assert run["optimizer"] == "ZeroRedundancyOptimizer"
        assert 0.3 < run["state_share"] < 0.7, run["state_share"]
        assert_losses_close(run["losses"], reference, FP32_RTOL)


def test_their_memory_estimates_are_within_10_percent_of_measured_peaks(four_ranks):
    """Estimated / measured peak: interleaved 0.93-0.99, tensor x data + zero1 0.948 (2026-11-27,
    these ranks alone, twice; 0.99 and 0.95 on 2026-11-26; 1.07 and 1.00 on 2026-11-25). In two
    whole-suite runs (2026-11-26 and -27) zero1 read 0.898 and 0.899: the same step's measured peak
    5% higher with the machine busy. The bound is the 10% above and that spread below (0.88)."""
    ratios = four_ranks[0]["memory"]
    assert all(0.88 <= r <= 1.1 for r in ratios.values()), ratios


def _cost(load_strategy, dims: dict):
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search.cost import build_cost
    from atorch.auto.strategy import Strategy
    from tests.helpers.hf import SEQ

    model = _llama("meta")
    strategy = resolve_strategy(model, Strategy(load_strategy))
    return build_cost(model, strategy, dims, 2.0, 0, 1e9, BATCH // dims.get("data", 1) * SEQ)


def _charged(load_strategy, dims: dict) -> dict:
    """{dim: {kind: (calls, payload bytes)}} of the cost's tensor and pipeline communication."""
    out: dict = {}
    cost = _cost(load_strategy, dims)
    for c in cost.comms:
        calls, payload = out.setdefault(c.dim, {}).get(c.kind, (0, 0))
        out[c.dim][c.kind] = (calls + c.messages, round(payload + c.elements * cost.comm_element_bytes(c)))
    return out


def _busiest(ranks: list[dict], dim: str, kind: str) -> tuple[int, int]:
    """The most (calls, bytes) of ``kind`` a rank made over ``dim``'s group (a pipeline over the
    whole world: its group is the world's, counted under any dim)."""
    return max(seen[kind] for rank in ranks for name, seen in rank.items()
               if kind in seen and (name == dim or dim == "pipeline" and kind == "send_recv"))


def test_the_interleaved_grid_is_charged_the_collectives_it_makes(four_ranks):
    """Each microbatch runs its stages' tensor collectives (15 all-reduces a microbatch on this
    Llama, the head's logit gather on the last stage, whole); each of a rank's 2 stages receives
    and sends forward and back. Charged before: 15 all-reduces, 1 gather of half the logits and 8
    sends and receives, where the code made 30, 2 of all of them and 12."""
    seen = [rank["traffic"] for rank in four_ranks]
    charged = _charged(INTERLEAVED, {"tensor": 2, "pipeline": 2, "data": 1})
    calls, payload = _busiest(seen, "tensor", "all_reduce")
    assert charged["tensor"]["all_reduce"][0] == calls
    assert charged["tensor"]["all_reduce"][1] == pytest.approx(payload, rel=0.01)
    assert charged["tensor"]["all_gather"] == _busiest(seen, "tensor", "all_gather")
    assert charged["pipeline"]["send_recv"] == _busiest(seen, "pipeline", "send_recv")
    # 1F1B over 4 stages: a middle rank receives and sends both ways (4 a microbatch)
    charged = _charged(PIPELINE4, {"pipeline": 4, "data": 1})
    assert charged["pipeline"]["send_recv"] == _busiest([r["pipeline4"] for r in four_ranks], "pipeline", "send_recv")


def test_under_bf16_autocast_the_stages_send_fp32_and_the_tensor_collectives_move_bf16(four_ranks):
    """The stages hand each other the residual stream, which autocast leaves in the weights'
    dtype (fp32); the row-parallel layers' outputs they all-reduce are bf16. Until 2026-11-29 the
    sends were charged at the compute dtype's 2 bytes: half what they move."""
    seen = [rank["amp_traffic"] for rank in four_ranks]
    charged = _charged(INTERLEAVED_AMP, {"tensor": 2, "pipeline": 2, "data": 1})
    assert charged["pipeline"]["send_recv"] == _busiest(seen, "pipeline", "send_recv"), (charged, seen)
    calls, payload = _busiest(seen, "tensor", "all_reduce")
    assert charged["tensor"]["all_reduce"][0] == calls
    assert charged["tensor"]["all_reduce"][1] == pytest.approx(payload, rel=0.01), (charged, seen)
    assert charged["tensor"]["all_gather"] == _busiest(seen, "tensor", "all_gather")  # the logits, bf16
    fp32 = _busiest([rank["traffic"] for rank in four_ranks], "pipeline", "send_recv")
    assert _busiest(seen, "pipeline", "send_recv") == fp32  # the same bytes sent as without autocast


def test_sequence_parallelism_on_the_grid_is_charged_the_collectives_it_makes(four_ranks):
    """Under sequence parallelism each microbatch's layers reduce-scatter (an all-reduce here)
    and gather the sequence, and all-reduce their norm weights' gradients; the head gathers the
    logits whole; the stages send a tensor rank's chunk of the hidden states: half the bytes of
    the grid without it."""
    seen = [rank["sequence_traffic"] for rank in four_ranks]
    dims = {"tensor": 2, "pipeline": 2, "data": 1}
    charged = _charged(SEQUENCE, dims)
    for kind in ("all_reduce", "all_gather"):
        calls, payload = _busiest(seen, "tensor", kind)
        assert charged["tensor"][kind][0] == calls, (kind, charged, seen)
        assert charged["tensor"][kind][1] == pytest.approx(payload, rel=0.01), (kind, charged, seen)
    sends = _busiest(seen, "pipeline", "send_recv")
    assert charged["pipeline"]["send_recv"] == sends
    whole = _busiest([rank["traffic"] for rank in four_ranks], "pipeline", "send_recv")
    assert sends[0] == whole[0] and sends[1] * 2 == pytest.approx(whole[1], rel=0.01)


def _assert_data_sync_charged(seen: list[dict], load_strategy, dims: dict, microbatches: int) -> None:
    """The pipeline model all-reduces its gradients over the data ranks a bucket at a time
    (atorch.pipeline.grad_sync; besides the step's loss totals), then ZeroRedundancyOptimizer
    broadcasts each data rank's updated share; the busiest rank's, as the cost charges them."""
    cost = _cost(load_strategy, dims)
    charged = {kind: (calls, payload) for kind, payload, calls in cost.data_sync_collectives()}
    largest = max((rank["data"] for rank in seen), key=lambda data: data["all_reduce"][1])
    calls, payload = largest["all_reduce"]
    assert set(charged) == {"all_reduce", "all_gather"} and not cost.grad_buckets
    assert cost.sync_overlap == {"all_reduce": ("backward",)}  # started inside the schedule (grad_sync.py)
    assert charged["all_reduce"][0] == calls - 1, (charged, largest)
    assert charged["all_reduce"][1] == pytest.approx(payload - 4 * microbatches, rel=0.05), (charged, largest)
    assert charged["all_gather"][0] == largest["broadcast"][0], (charged, largest)
    assert charged["all_gather"][1] == pytest.approx(largest["broadcast"][1], rel=0.05), (charged, largest)


def test_zero1_on_the_grid_is_charged_the_pipeline_sync_and_its_broadcasts(four_ranks):
    """tensor=2 x data=2 + zero1 (a one-stage pipeline: its sync had been charged as one
    all-reduce)."""
    _assert_data_sync_charged([rank["zero1_traffic"] for rank in four_ranks], TENSOR_DATA_ZERO1,
                              {"tensor": 2, "pipeline": 1, "data": 2}, 1)


EIGHT_RANKS = DeviceContext(8, 8, torch.device("cpu"), None, 2**34)


def test_the_space_has_virtual_stages_and_zero1_on_a_tensor_x_pipeline_grid():
    from collections import Counter

    from atorch.auto.search.space import candidate_space, layout_space

    eligible, ineligible = layout_space(_llama("meta"), EIGHT_RANKS, BATCH, "unpack_dict")
    texts = {layout.text for layout in eligible}
    assert "tensor=2 x pipeline=2 x data=2, microbatches=2, virtual stages=2" in texts
    reasons = {layout.text: why for layout, why in ineligible}
    assert "to make 8 stages" in reasons["tensor=2 x pipeline=4, microbatches=4, virtual stages=2"]
    mixed = [layout for layout in eligible if layout.method and layout.method[0] == "mixed_parallel"]
    candidates = candidate_space(EIGHT_RANKS, ["zero2", "fsdp", "checkpoint", "amp_native", "module_replace"],
                                 layouts=mixed, counts=Counter())
    with_zero1 = [s for s in candidates if "zero1" in s]
    assert {s.get("mixed_parallel").virtual_pipeline_size for s in with_zero1} == {1, 2}


def _pipeline_rows(memory: int) -> list[dict]:
    from atorch.auto.search.profiles import load_profile
    from atorch.cli.plan_search import plan_search

    result = plan_search(_llama("meta"), 8, 32, 16, load_profile("h100_80gb"), 2.0, ["fp8", "module_replace"], memory)
    rows = [r for r in result["rows"] if "memory" in r]
    keys = [(r["layout"], tuple(r["names"])) for r in rows]
    assert len(keys) == len(set(keys))  # a retry that is also a layout of its own is costed once
    return [r for r in rows if r["dims"]["pipeline"] > 1]


def test_plan_search_gives_a_pipeline_over_memory_more_microbatches_until_one_sequence():
    """A pipeline's microbatches are its accumulation: over memory, plan --search tries it again
    with them doubled while they divide the per-rank batch (NeMo's 70B runs one sequence a
    microbatch; the layouts' p and 2p microbatches hold 4-8 on 512 ranks); one that fits goes on
    while its estimated step gets faster."""
    nothing_fits = _pipeline_rows(1)
    tried: dict = {}  # every count from the layout's own to one sequence a microbatch
    for row in nothing_fits:
        dims = row["dims"]
        assert dims["accumulation"] == 1
        key = (dims["tensor"], dims["pipeline"], dims["virtual_stages"], tuple(row["names"]), row["per_rank_batch"])
        tried.setdefault(key, set()).add(dims["microbatches"])
    for (_, pipeline, _, _, per_rank), counts in tried.items():
        assert counts == {pipeline * 2**k for k in range(8) if pipeline * 2**k <= per_rank}, counts
    assert any("mixed_parallel" in r["names"] and r["dims"]["virtual_stages"] == 2 and "zero1" in r["names"]
               for r in nothing_fits)
    # everything fits: more microbatches while the estimated step gets faster (a smaller bubble)
    fitting: dict = {}
    for row in _pipeline_rows(2**50):
        dims = row["dims"]
        key = (dims["tensor"], dims["pipeline"], dims["virtual_stages"], tuple(row["names"]), row["per_rank_batch"])
        fitting.setdefault(key, {})[dims["microbatches"]] = row["seconds"]
    for (_, pipeline, _, _, per_rank), seconds in fitting.items():
        most = max(seconds)
        assert sorted(seconds) == [pipeline * 2**k for k in range(8) if pipeline * 2**k <= most], seconds
        assert most == per_rank or seconds[most] >= seconds[most // 2], seconds
    assert any(len(seconds) > 2 for seconds in fitting.values())  # beyond the layouts' p and 2p


def test_deepspeeds_zero1_is_refused_beside_a_pipeline_and_the_error_names_the_fix():
    """DeepSpeed's engine took the pipeline model whole and failed in its first step (KeyError
    inside DeepSpeed); refused at plan time, pipeline_parallel and mixed_parallel alike."""
    from atorch.auto.plan import plan_strategy
    from atorch.auto.strategy import Strategy
    from atorch.errors import StrategyConflictError

    for layout in (_mixed(2, 2, virtual=2), ("pipeline_parallel", {"num_microbatches": 2})):
        with pytest.raises(StrategyConflictError, match="use zero1 without use_ds_zero"):
            plan_strategy(Strategy([layout, ("zero1", {"use_ds_zero": True})]), EIGHT_RANKS)
    planned, _ = plan_strategy(Strategy([_mixed(2, 2, virtual=2), "zero1"]), EIGHT_RANKS)
    assert planned.opt_names == ["parallel_mode", "mixed_parallel", "zero1"]


def _eight_ranks() -> dict:
    return {"train": _train(GRID_ZERO1), "memory": _memory_ratios({"grid": GRID_ZERO1}),
            "traffic": _traffic(GRID_ZERO1)}


@pytest.mark.slow  # 8 processes on 2 cores: 26 s
def test_the_whole_grid_with_virtual_stages_and_zero1_on_8_ranks():
    """tensor=2 x pipeline=2 x data=2, 2 virtual stages a rank, zero1 over each stage's data ranks:
    the serial run's losses, half the state a rank, memory estimated at 1.09 of measured."""
    reference = _serial_losses()
    ranks = run_distributed(_eight_ranks, 8, timeout_s=900)
    for rank in ranks:
        run = rank["train"]
        assert run["methods"] == ["parallel_mode", "mixed_parallel", "zero1"]
        assert (run["schedule"], run["optimizer"]) == ("interleaved", "ZeroRedundancyOptimizer")
        assert 0.3 < run["state_share"] < 0.7, run["state_share"]
        assert_losses_close(run["losses"], reference, FP32_RTOL)
    assert 0.9 <= ranks[0]["memory"]["grid"] <= 1.1, ranks[0]["memory"]
    _assert_data_sync_charged([rank["traffic"] for rank in ranks], GRID_ZERO1, {"tensor": 2, "pipeline": 2, "data": 2}, 2)
