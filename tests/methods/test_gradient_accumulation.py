"""The gradient_accumulation method: a batch trained as micro-batches is the same optimizer step.

On 2 gloo ranks under ddp, zero1 and fsdp, against the single-process run on the whole batch
(fp32, SGD); with auto_accelerate's gradient_accumulation_steps the two multiply; what cannot
accumulate is refused before anything runs; the search generates it only where its steps divide
a rank's batch; its memory estimate against the measured peak.
"""

import pytest
import torch

import atorch
from atorch.auto import auto_accelerate
from atorch.auto.environment import DeviceContext
from atorch.auto.search.space import candidate_space, layout_space, method_labels
from atorch.auto.strategy import Strategy, parse_strategy
from atorch.errors import AtorchConfigError
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_sensitive
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, global_mean, lm_loss, train_losses

STEPS, BATCH, LR = 5, 8, 0.05
ACCUMULATE = ("gradient_accumulation", {"steps": 2})
STRATEGIES = {"ddp": ["parallel_mode", ACCUMULATE], "zero1": [ACCUMULATE, "parallel_mode", "zero1"],
              "fsdp": ["parallel_mode", "fsdp", ACCUMULATE]}


def train(load_strategy, batch_size: int = BATCH, extra_accumulation: int = 1) -> dict:
    """The user's loop: a loss per optimizer step (the mean of its micro-batches'), the samples
    each loader batch held on this rank, and the strategy as returned."""
    torch.manual_seed(0)
    status, result, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.SGD, TokenDataset(), lm_loss, optim_args={"lr": LR},
        dataloader_args={"batch_size": batch_size}, model_input_format="unpack_dict", load_strategy=load_strategy,
        gradient_accumulation_steps=extra_accumulation)
    assert status
    losses, micro, samples = [], [], []
    batches = iter(result.dataloader)
    while len(losses) < STEPS:
        batch = result.prepare_input(next(batches), atorch.device())
        samples.append(len(batch["input_ids"]))
        loss = result.loss_func(batch, result.model(**batch))
        micro.append(loss.detach())
        result.backward(loss)
        if result.sync_gradients:
            losses.append(global_mean(torch.stack(micro).mean()))
            micro = []
        result.step()
    return {"losses": losses, "samples": sorted(set(samples)), "strategy": strategy.to_json(),
            "steps": result.args.get("gradient_accumulation_steps", 1)}


def _all_strategies() -> dict:
    return {name: train(strategy) for name, strategy in STRATEGIES.items()}


def test_micro_batches_on_2_ranks_train_like_the_whole_batch():
    reference = train_losses([], steps=STEPS, batch_size=BATCH, lr=LR)["losses"]
    # what a wrong accumulation gives: the loss not divided (twice the step), a step per micro-batch
    controls = {"loss not divided": train_losses([], steps=STEPS, batch_size=BATCH, lr=LR * 2)["losses"],
                "no accumulation": train_losses([], steps=STEPS, batch_size=BATCH // 2, lr=LR)["losses"]}
    results = run_distributed(_all_strategies, 2)[0]
    for name, run in results.items():
        assert_losses_close(run["losses"], reference, FP32_RTOL)
        assert_sensitive(run["losses"], controls, FP32_RTOL)
        assert run["samples"] == [BATCH // 2 // 2], (name, run["samples"])  # 8 over 2 ranks, in 2 micro-batches
        assert run["steps"] == 2
        # the strategy carries it: saved and loaded, it is the same method with the same steps
        loaded = parse_strategy(run["strategy"])
        assert loaded.get("gradient_accumulation").steps == 2, name


def test_with_gradient_accumulation_steps_the_two_multiply():
    # 2 micro-batches of each batch of 4, and 2 batches a step: 8 samples an optimizer step
    run = train([ACCUMULATE], batch_size=BATCH // 2, extra_accumulation=2)
    assert run["steps"] == 4 and run["samples"] == [BATCH // 4]
    reference = train_losses([], steps=STEPS, batch_size=BATCH, lr=LR)["losses"]
    assert_losses_close(run["losses"], reference, FP32_RTOL)


@pytest.mark.parametrize("strategy, match", [
    ([("pipeline_parallel", {"num_microbatches": 2}), ACCUMULATE], "num_microbatches"),
    (["parallel_mode", ("zero2", {"use_ds_zero": True}), ACCUMULATE], "DeepSpeed's engine"),
    (["parallel_mode", ("zero2", {"not_use_fsdp": True}), ACCUMULATE], "fairscale"),
    ([("gradient_accumulation", {"steps": 3})], "does not divide the 8 samples"),
    ([("gradient_accumulation", {"steps": 1})], "greater than or equal to 2"),
])
def test_what_cannot_accumulate_is_refused_before_a_step(strategy, match):
    model = TinyTransformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AtorchConfigError, match=match):
        auto_accelerate(model, torch.optim.SGD, TokenDataset(), lm_loss, dataloader_args={"batch_size": BATCH},
                        model_input_format="unpack_dict", load_strategy=strategy)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_trainers_refuse_it_and_name_their_own_setting():
    from atorch.integrations.common import SEARCH_EXCLUDED, check_strategy

    with pytest.raises(AtorchConfigError, match="trainer's own gradient accumulation"):
        check_strategy([ACCUMULATE], "AtorchTrainer")
    assert "gradient_accumulation" in SEARCH_EXCLUDED


def _accumulations(world: int, global_batch: int | None) -> set:
    ctx = DeviceContext(world, world, torch.device("cpu"), None, 2**40)
    layouts, _ = layout_space(TinyTransformer(), ctx, global_batch)
    space = candidate_space(ctx, layouts=layouts, model=TinyTransformer(), global_batch=global_batch)
    return {(s.get("gradient_accumulation").steps, s.get("parallel_mode").dims[-1][1] if s.get("parallel_mode") else 1)
            for s in space if "gradient_accumulation" in s}


def test_the_search_tries_only_steps_that_divide_a_data_ranks_batch():
    # 4 samples over data=2: 2 a rank, so 2 micro-batches and not 4; on a layout with data=1
    # (tensor=2) a rank has all 4
    assert _accumulations(2, 4) == {(2, 2), (2, 1), (4, 1)}
    assert _accumulations(2, 8) == {(2, 2), (4, 2), (2, 1), (4, 1)}
    assert _accumulations(1, 2) == {(2, 1)}
    labels = method_labels(Strategy([ACCUMULATE, ("checkpoint", {"selective": True})]).items())
    assert labels == ["gradient_accumulation x2", "checkpoint (selective)"]


def _estimated_and_measured() -> dict:
    """Per strategy: estimated / measured peak of one optimizer step of 2 micro-batches (8
    sequences a rank in 2 of 4); the estimate from the search's real-tensor probe of the whole
    batch, the method's cost term dividing it."""
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.engine import cost_candidate
    from tests.helpers.comms import step_traffic
    from tests.helpers.hf import CountingTokens, tiny_llama

    data, ctx, out = CountingTokens(), DeviceContext.detect(), {}
    whole = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    for name, methods in {"ddp": ["parallel_mode"], "fsdp": ["parallel_mode", "fsdp"]}.items():
        for accumulate in (False, True):
            strategy = methods + ([("gradient_accumulation", {"steps": 2})] if accumulate else [])
            measured = step_traffic(tiny_llama(), strategy, data, 16, peak=True)["peak"]
            model = tiny_llama()

            def probe(s, counts, dims, model=model):
                saved = cost.activation_bytes(model, s, whole, "unpack_dict", lambda b, o: o.loss, ctx, counts)
                return saved, whole["input_ids"].numel()

            step, _ = cost_candidate(model, resolve_strategy(model, Strategy(strategy)), {"data": 2}, 2.0, probe, "cpu")
            out[(name, accumulate)] = (step.memory().total, measured)
    return out


@pytest.mark.slow  # 6 s; tests/auto/search/test_cost_memory.py checks accumulation's memory term in the default run
def test_its_memory_estimate_is_within_10_percent_of_the_measured_peak():
    pytest.importorskip("transformers")
    peaks = run_distributed(_estimated_and_measured, 2)[0]
    ratios = {key: estimated / measured for key, (estimated, measured) in peaks.items()}
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
    for name in ("ddp", "fsdp"):  # it saves memory, and the estimate says so
        assert peaks[(name, True)][1] < peaks[(name, False)][1], peaks
        assert peaks[(name, True)][0] < peaks[(name, False)][0], peaks


def _dry_run_with_a_failing_rank(report_file: str):
    from atorch.auto.registry import MethodSpec, Stage, get_method, register_method
    from tests.auto.search.test_one_rank_failure import TIMEOUT_S, ForwardFailsConfig, _fail_in_forward

    try:
        get_method("_forward_fails")
    except ValueError:
        register_method(MethodSpec("_forward_fails", ForwardFailsConfig, {Stage.REWRITE: _fail_in_forward}, "fails"))
    status, _, _ = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, dataloader_args={"batch_size": BATCH},
        model_input_format="unpack_dict", load_strategy=["parallel_mode", "_forward_fails", ACCUMULATE],
        ignore_dryrun_on_load_strategy=False, dryrun_timeout=TIMEOUT_S, use_search_cache=False,
        report_file=report_file)
    return status


def test_a_dry_run_reduces_the_accumulated_gradients(tmp_path):
    """Rank 1's forward raises: rank 0 must wait in DDP's all-reduce of its second micro-batch
    until the candidate's timeout, then both record the failure. A dry run that never turned the
    reduction back on (its backward without the model) ran on alone: rank 0 went on to the timed
    steps, measured a step without the all-reduce, and the ranks hung in different agreements."""
    from atorch.auto.search.report import SearchReport

    path = str(tmp_path / "report.json")
    assert run_distributed(_dry_run_with_a_failing_rank, 2, path, timeout_s=120) == [False, False]
    (candidate,) = SearchReport.load(path).candidates
    assert candidate.status == "failed" and candidate.reason == "rank 1: RuntimeError: forward broke on rank 1"


def test_the_cost_model_keeps_one_micro_batchs_activations_alive():
    # What the method is for: each micro-batch's activations, not the whole batch's. The search
    # reads it from the cost term; only a slow test saw it before (issue 56).
    import torch

    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search.cost import build_cost
    from atorch.auto.strategy import Strategy
    from tests.helpers.hf import SEQ, tiny_llama

    with torch.device("meta"):
        model = tiny_llama()
    costs = {}
    for steps in (1, 2, 4):
        methods = ["parallel_mode"] + ([("gradient_accumulation", {"steps": steps})] if steps > 1 else [])
        cost = build_cost(model, resolve_strategy(model, Strategy(methods)), {"data": 2}, 2.0, 4096, 1e9, 4 * SEQ)
        costs[steps] = cost
    assert [costs[s].activations for s in (1, 2, 4)] == [4096, 2048, 1024]
    assert [costs[s].memory().activations for s in (1, 2, 4)] == [4096, 2048, 1024]
