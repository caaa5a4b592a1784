"""The probe's step timeline (atorch/auto/search/timeline.py): activations and gradients over
forward and backward, so the estimate holds where counting the forward's saved tensors does not
(the loss's gradient, checkpointing's recomputed block while the later gradients exist)."""

import pytest
import torch

from atorch.auto.search.timeline import StepTimeline, envelope


def test_envelope_keeps_the_worst_moment_for_each_weight_of_the_gradients():
    # (activations, gradients, weight copies) at the forward's end, a moment in backward, the end
    moments = [(100, 0, 10), (70, 50, 5), (10, 100, 0)]
    points = envelope(moments, grad_total=100, copy_total=10, reference=100)
    assert (1.0, 0.0, 1.0) in points and (0.7, 0.5, 0.5) in points and (0.1, 1.0, 0.0) in points

    def peak(acts, grads, copies=0):
        return max(acts * a + grads * g + copies * c for a, g, c in points)

    assert peak(100, 0) == 100  # no gradients kept: the forward's end
    assert peak(100, 100) == 120  # every gradient kept: the moment in backward
    assert peak(10, 100) == 101  # activations divided by 10: the end of backward
    assert peak(100, 0, 10) == 110  # with the weight copies, all alive at the forward's end
    assert envelope([], 1, 1, 1) == () and envelope(moments, 100, 10, 0) == ()


def test_moments_split_the_gradients_from_the_activations_and_skip_the_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    x = torch.randn(512, 256)
    with StepTimeline(model) as timeline:
        loss = model(x).square().mean()
        forward_end = len(timeline.events)
        loss.backward()
    grads = [p.grad for p in model.parameters()]
    moments = timeline.moments(grads)
    _, grads_at_end, copies, _ = moments[-1]  # the last local peak: every gradient exists
    assert grads_at_end == sum(g.nbytes for g in grads) and copies == 0
    # the forward keeps three 512 x 256 fp32 outputs (the layers' and the tanh's, each saved by
    # the next op): the weights, though the linear layers take views of them, are not counted
    forward = max(m[0] for m in moments if m[3] < forward_end)
    assert forward == pytest.approx(3 * 512 * 256 * 4, rel=0.01)


def test_autocast_weight_copies_are_told_apart():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    with StepTimeline(model) as timeline:
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(torch.randn(64, 256)).float().square().mean()
        forward_end = len(timeline.events)
        loss.backward()
    moments = timeline.moments([p.grad for p in model.parameters()])
    copies = max(m[2] for m in moments if m[3] < forward_end)
    assert copies == 2 * (256 * 256 + 256) * 2  # both layers' weights and biases, in bf16


def _ratios():
    from atorch.auto.search import measure
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    strategies = [[], ["checkpoint"], [("amp_native", "bf16")], [("amp_native", "bf16"), "checkpoint"]]
    report = measure(TinyTransformer(layers=6), strategies, torch.optim.AdamW, TokenDataset(), lm_loss,
                     optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 16}, model_input_format="unpack_dict",
                     timed_steps=1)
    return {" + ".join(c.names): c.estimated_peak_bytes / c.measured_peak_bytes for c in report.candidates}


def test_estimates_match_measured_peaks_with_checkpointing_and_amp():
    # Counting saved tensors put the checkpointed estimate at 0.56 of measured on a deep Llama;
    # the timeline measures the same step the dry run does, on one rank.
    ratios = _ratios()
    assert len(ratios) == 4
    assert all(0.97 <= r <= 1.03 for r in ratios.values()), ratios


def test_unit_spans_tell_what_each_unit_keeps_and_the_most_alive_while_it_runs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 8))
    timeline = StepTimeline(model)
    handles = timeline.watch(model, ["2", "0", "4"])  # any order: spans follow the forward
    with timeline:
        loss = model(torch.randn(512, 256)).square().mean()
        forward_end = len(timeline.events)
        loss.backward()
    for handle in handles:
        handle.remove()
    grads = [p.grad for p in model.parameters()]
    reference = max(m[0] for m in timeline.moments(grads) if m[3] < forward_end)
    spans = timeline.unit_spans(grads, forward_end, reference)
    assert [s.name for s in spans] == ["0", "2", "4"]
    hidden = 512 * 256 * 4 / reference  # one 512 x 256 fp32 tensor
    # the first unit's span starts with the step: the input (saved by the first linear layer for
    # its weight's gradient) and the tanh's output (saved by the tanh and the next linear layer)
    assert spans[0].kept == pytest.approx(2 * hidden) and spans[1].kept == pytest.approx(hidden)
    assert spans[2].kept < 0.05 and sum(s.kept for s in spans) <= 1.0
    # while a unit runs, the earlier units' kept tensors are alive too; its backward adds gradients
    assert spans[1].forward_peak >= spans[0].kept + spans[1].kept
    assert all(s.backward_peak > 0 for s in spans)
    assert timeline.unit_spans(grads, forward_end, 0) == ()


def test_the_probe_measures_the_model_output_a_pipeline_schedule_holds():
    # A training step drops the logits once the loss is computed (the loss's backward needs its
    # own tensors, not them); a pipeline's last stage holds them until the microbatch's backward.
    # Without them deep-narrow's checkpointed tensor x pipeline layouts estimated 0.82 of their
    # measured peak (4 buffers of the logits' size alive at the loss's backward, 3 estimated).
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.strategy import Strategy
    from tests.helpers.models import VOCAB, TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    batch = {k: torch.stack([TokenDataset(n=4)[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    counts: list = []
    reference = cost.activation_bytes(model, resolve_strategy(model, Strategy([("parallel_mode", {})])), batch,
                                      "unpack_dict", lm_loss, DeviceContext.detect(), counts)
    spans = counts[4]  # flops, operators, profile, hooked tensors, spans, attention FLOPs, traffic
    assert [s.name for s in spans] == ["embed", "blocks.0", "blocks.1", "head"]
    logits = batch["input_ids"].numel() * VOCAB * 4
    assert spans[-1].output * reference == pytest.approx(logits)
    assert all(s.output == 0 for s in spans[:-1])


def test_a_pipeline_stage_keeps_its_units_for_each_microbatch_in_flight():
    from atorch.auto.search.timeline import UnitSpan
    from atorch.methods.pipeline_parallel import _stage_moments

    def moments(*args):
        return [pytest.approx(moment) for moment in _stage_moments(spans, ranges, *args)]

    spans = (UnitSpan("a", 0.2, 0.2, 0.3), UnitSpan("b", 0.3, 0.5, 0.6), UnitSpan("c", 0.5, 1.0, 1.1))
    ranges = [["a"], ["b", "c"]]
    # 1F1B, 2 microbatches: stage 0 holds both (2 x 0.2, plus 0.1 more while one runs) before any
    # gradient exists, then one with the gradients; the last stage holds 1 (its 0.8, plus 0.1
    # beyond the first stage's 0.2) and, running another forward after it, has the gradients
    first, then = ((2 * 0.2 + 0.1) / 2, 0.0, 1.0), ((0.2 + 0.1) / 2, 1.0, 1.0)
    assert moments(2, 2, "1f1b") == [first, then, ((0.8 + 0.1) / 2, 1.0, 1.0)]
    # GPipe: every stage holds every microbatch
    last = ((2 * 0.8 + 0.1) / 2, 0.0, 1.0), ((0.8 + 0.1) / 2, 1.0, 1.0)
    assert moments(2, 2, "gpipe") == [first, then, *last]
    # 4 microbatches under 1F1B: the first stage holds 2, each a quarter of the batch, with the gradients
    assert moments(2, 4, "1f1b") == [((2 * 0.2 + 0.1) / 4, 1.0, 1.0), ((0.8 + 0.1) / 4, 1.0, 1.0)]
    # the model's output (0.25 of the step's peak) is the last stage's for each microbatch it
    # holds, alive through the backward: 1F1B holds one there, GPipe both
    spans = (*spans[:2], UnitSpan("c", 0.5, 1.0, 1.1, output=0.25))
    assert moments(2, 2, "1f1b")[-1] == ((0.8 + 0.25 + 0.1) / 2, 1.0, 1.0)
    assert moments(2, 2, "gpipe")[-2:] == [((2 * (0.8 + 0.25) + 0.1) / 2, 0.0, 1.0),
                                           ((0.8 + 0.25 + 0.1) / 2, 1.0, 1.0)]
    assert _stage_moments((), ranges, 2, 2, "1f1b") is None
    assert _stage_moments(spans, [["a"], ["x"]], 2, 2, "1f1b") is None  # not the split the probe saw


def test_a_tensor_rank_splits_only_what_lies_inside_the_blocks():
    from atorch.auto.search.timeline import UnitSpan
    from atorch.methods.tensor_parallel import _span_moments, _split_spans

    # embedding, two blocks, head (with the loss)
    spans = (UnitSpan("e", 0.1, 0.1, 0.15), UnitSpan("b0", 0.2, 0.5, 0.6), UnitSpan("b1", 0.2, 0.7, 0.8),
             UnitSpan("h", 0.3, 1.0, 0.9))
    blocks = [False, True, True, False]
    inside = 0.5
    split = _split_spans(spans, blocks, inside, checkpointed=False)
    # a block keeps `inside` of what it kept; the embedding and the head keep all of theirs
    assert [s.kept for s in split] == pytest.approx([0.1, 0.1, 0.1, 0.3])
    # what a unit has alive beyond the earlier units' kept: `inside` of it in a block, all of it
    # outside: b1 ran with 0.4 over the 0.3 kept before it; split, 0.2 over 0.2
    assert [s.forward_peak for s in split] == pytest.approx([0.1, 0.1 + 0.2, 0.2 + 0.2, 0.3 + 0.5])
    assert [s.backward_peak for s in split] == pytest.approx([0.15, 0.1 + 0.25, 0.2 + 0.25, 0.3 + 0.4])
    # checkpointed: a block keeps its input, which is not split
    kept = _split_spans(spans, blocks, inside, checkpointed=True)
    assert [s.kept for s in kept] == pytest.approx([0.1, 0.2, 0.2, 0.3])
    assert kept[3].forward_peak == pytest.approx(0.5 + 0.5)

    # moments: each unit's forward (no gradient, the copies cast so far) and backward (its and the
    # later units' gradients; the copies its and earlier units' saved tensors hold)
    model = torch.nn.ModuleDict({"e": torch.nn.Linear(1, 1, bias=False), "b0": torch.nn.Linear(2, 1, bias=False),
                                 "b1": torch.nn.Linear(3, 1, bias=False), "h": torch.nn.Linear(4, 1, bias=False)})
    moments = _span_moments(split, blocks, model, checkpointed=False)
    assert moments[0] == pytest.approx((0.1, 0.0, 0.1)) and moments[1] == pytest.approx((0.15, 1.0, 0.1))
    assert moments[-1] == pytest.approx((0.7, 0.4, 1.0))
    # a checkpointed block's copies are not held after its recompute
    moments = _span_moments(kept, blocks, model, checkpointed=True)
    assert moments[-1][2] == pytest.approx((1 + 4) / 10)


def _torch_interleaved_worst(rank, stages, virtual, m, weights):
    """The most each rank holds under torch's own interleaved 1F1B order, weighted per local
    stage, before and after its first backward."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    fake = SimpleNamespace(n_local_stages=virtual, microbatches_per_round=m // max(1, m // stages),
                           pp_group_size=stages, _n_microbatches=m)
    held, backward_ran, worst = [0] * virtual, False, {}
    for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank):
        if action is None:
            continue
        forward = action.computation_type == _ComputationType.FORWARD
        held[action.stage_index // stages] += 1 if forward else -1
        backward_ran = backward_ran or not forward
        alive = sum(n * w for n, w in zip(held, weights))
        worst[backward_ran] = max(worst.get(backward_ran, 0.0), alive)
    return worst


@pytest.mark.parametrize("stages,virtual,m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 2, 12)])
def test_interleaved_holding_follows_torchs_own_order(stages, virtual, m):
    from atorch.methods.pipeline_parallel import interleaved_held

    for rank in range(stages):
        weights = [1.0 + 10.0 ** k for k in range(virtual)]  # tells the local stages apart
        worst = {}
        for held, backward_ran in interleaved_held(rank, stages, virtual, m):
            alive = sum(n * w for n, w in zip(held, weights))
            worst[backward_ran] = max(worst.get(backward_ran, 0.0), alive)
        assert worst == pytest.approx(_torch_interleaved_worst(rank, stages, virtual, m, weights))


def test_an_interleaved_rank_holds_more_than_its_1f1b_microbatches():
    from atorch.auto.search.timeline import UnitSpan
    from atorch.methods.pipeline_parallel import _stage_moments

    # 4 equal stages on 2 ranks (2 each), 4 microbatches: rank 0 runs 4 warm-up forwards (stage 0
    # twice, stage 2 twice) and one more before its first backward: 5 stage-microbatches of 0.2,
    # where 1F1B without interleaving would hold 2 microbatches of both its stages (4 x 0.2).
    spans = tuple(UnitSpan(name, 0.2, 0.2 * (i + 1), 0.2 * (i + 1)) for i, name in enumerate("abcd"))
    ranges = [["a"], ["b"], ["c"], ["d"]]
    worst = max(activations for activations, _, _ in _stage_moments(spans, ranges, 2, 4, "interleaved"))
    assert worst == pytest.approx(5 * 0.2 / 4)
    assert max(a for a, _, _ in _stage_moments(spans, [["a", "b"], ["c", "d"]], 2, 4, "1f1b")) == pytest.approx(
        2 * 0.4 / 4)


def test_a_later_backward_holds_the_low_precision_gradients_of_the_weight_copies():
    """With each unit's parameters, a stage's second and later backwards add a moment per unit:
    the running microbatch's activations as the probe had them in that unit's backward, and the
    copies' gradients of that unit and the units after it (a copies share of 1 + their share)."""
    from atorch.auto.search.timeline import UnitSpan
    from atorch.methods.pipeline_parallel import _stage_moments

    spans = (UnitSpan("a", 0.2, 0.2, 0.3), UnitSpan("b", 0.3, 0.5, 0.6), UnitSpan("c", 0.5, 1.0, 1.1))
    ranges = [["a"], ["b", "c"]]
    plain = _stage_moments(spans, ranges, 2, 2, "1f1b")
    moments = _stage_moments(spans, ranges, 2, 2, "1f1b", {"a": 10, "b": 30, "c": 10})
    # stage 0 holds both microbatches (1F1B with 2): none besides the running one after its
    # second backward, which has a's 0.2 + 0.1 alive; stage 1 holds one: in c's backward 0.9 of
    # the step (b's and c's kept, 0.1 more), c's copies' gradients (a quarter of the stage's); in
    # b's, b's 0.3 + 0.1 (c's freed), every copy's gradient
    pile = [pytest.approx(m) for m in ((0.3 / 2, 1.0, 2.0), (0.9 / 2, 1.0, 1.25), (0.4 / 2, 1.0, 2.0))]
    assert list(moments) == [*plain[:2], pile[0], plain[2], *pile[1:]]
    # one microbatch: no later backward
    assert _stage_moments(spans, ranges, 2, 1, "1f1b", {"a": 10, "b": 30, "c": 10}) == \
        _stage_moments(spans, ranges, 2, 1, "1f1b")
