"""The general split (tracing): eligibility and units without processes; models no layout knows
(the ModuleList model, GPT-2, BERT with tied heads) trained on 2 and 4 gloo ranks against the
serial model; a data-dependent forward refused."""

import pytest
import torch

from atorch.pipeline import pipeline_eligibility
from atorch.pipeline.layouts import DecoderLMLayout, SequentialLayout, layout_for
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_sensitive
from tests.helpers.dist import run_distributed
from tests.pipeline.models import (
    HIDDEN,
    IN,
    LR,
    Block,
    batches,
    chain_loss,
    chain_model,
    hf_pipeline_losses,
    hf_serial_losses,
    loop_model,
    pipeline_losses,
    serial_losses_of,
    token_batches,
    train_loop_model,
)


def test_eligibility_says_which_models_split_and_why_not():
    x = {"x": torch.randn(2, IN)}
    assert pipeline_eligibility(loop_model(), 2, x) is None
    assert pipeline_eligibility(loop_model(), 4, x) is None
    assert pipeline_eligibility(loop_model(), 2) is None  # structure only: no example inputs
    assert "needs 5 boundaries" in pipeline_eligibility(loop_model(), 6, x)
    reason = pipeline_eligibility(loop_model(stop_on_data=True), 2, x)
    assert "cannot trace LoopNet's forward" in reason and "h.abs().max() > 100" in reason
    assert "control flow on a tensor's value" in reason and "register_layout" in reason
    assert pipeline_eligibility(chain_model(), 2) is None
    assert "does not know how Linear's forward flows" in pipeline_eligibility(torch.nn.Linear(2, 2), 2)
    assert "lacks the traced inputs ['x']" in pipeline_eligibility(loop_model(), 2, {"input": x["x"]})


def test_eligibility_traces_hugging_face_models_on_meta():
    from tests.helpers.hf import tiny_bert, tiny_gpt2, tiny_llama

    for build in (tiny_gpt2, tiny_bert, tiny_llama):
        assert pipeline_eligibility(build(), 2) is None
    with torch.device("meta"):
        meta = tiny_gpt2()
    assert pipeline_eligibility(meta, 3) is None


def test_units_follow_the_module_tree():
    layout = layout_for(loop_model())
    assert layout.traced and layout.units == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert layout.layer_units == layout.units[1:5] and layout.inputs == ["x"]
    # leaf_module_cls keeps a class whole: the blocks' ModuleList is not opened when its class is a leaf
    whole = layout_for(loop_model(), leaf_cls=[torch.nn.ModuleList])
    assert whole.units == ["embed", "blocks", "head"]
    from tests.helpers.hf import tiny_gpt2, tiny_llama

    gpt2 = layout_for(tiny_gpt2())
    assert gpt2.units[:4] == ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"]
    assert gpt2.units[-2:] == ["transformer.ln_f", "lm_head"] and gpt2.inputs == ["input_ids"]
    blocks = layout_for(loop_model(), layer_cls=Block)
    assert blocks.layer_units == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    # the known layouts stay the fast path
    assert isinstance(layout_for(tiny_llama()), DecoderLMLayout)
    assert isinstance(layout_for(chain_model()), SequentialLayout)


def _two_rank_traced_runs():
    from atorch.errors import NotSupportedError
    from atorch.pipeline import PipelineModel
    from tests.helpers.hf import tiny_bert, tiny_gpt2

    out = {}
    # the ModuleList model, cut by name, 1F1B
    model = PipelineModel(loop_model(), num_microbatches=4, pipeline_cuts=["blocks.1"], loss_fn=chain_loss,
                          broadcast_and_average_loss=True)
    out["cuts"] = {"losses": pipeline_losses(model, input_name="x"), "units": model.local_units}
    # automatically partitioned, interleaved: 2 ranks x 2 stages
    model = PipelineModel(loop_model(), num_microbatches=4, auto_partition=True, virtual_pipeline_size=2,
                          schedule="interleaved", loss_fn=chain_loss, broadcast_and_average_loss=True)
    out["interleaved"] = {"losses": pipeline_losses(model, input_name="x"), "units": model.local_units}
    # GPT-2 (its head tied to the embedding: stage 0 and stage 1 each hold a copy) and BERT masked LM
    for name, build, masked in (("gpt2", tiny_gpt2, False), ("bert", tiny_bert, True)):
        model = PipelineModel(build(), num_microbatches=4, auto_partition=True, broadcast_and_average_loss=True)
        losses = hf_pipeline_losses(model, masked=masked)
        tied = dict(model.local_named_parameters())
        embed = tied.get("transformer.wte.weight", tied.get("bert.embeddings.word_embeddings.weight"))
        head = tied.get("lm_head.weight", tied.get("cls.predictions.decoder.weight"))
        out[name] = {"losses": losses, "units": model.local_units, "tied": [t.detach().clone() for t in (embed, head) if t is not None]}
    # deallocate_pipeline_outputs: bytes of sent stage outputs still referenced at each backward
    for name, build, schedule, key in (("1f1b", chain_model, "1f1b", "input"), ("traced", loop_model, "1f1b", "x"),
                                       ("gpipe", chain_model, "gpipe", "input")):
        for free in (False, True):
            model = PipelineModel(build(), num_microbatches=4, auto_partition=True, schedule=schedule,
                                  loss_fn=chain_loss, broadcast_and_average_loss=True, deallocate_pipeline_outputs=free)
            held = [0]
            model.run_train(**{key: batches()[0][0]}, target=batches()[0][1])  # builds a traced model's stages
            for stage in model.stages:
                _record_held_outputs(stage, held)
            out[f"dealloc_{name}_{free}"] = {"losses": pipeline_losses(model, input_name=key)[:4], "held": max(held)}
    # through auto_accelerate: pipeline_parallel splits the ModuleList model too
    out["auto"] = train_loop_model([("parallel_mode", ([("pipeline", 2)], None)),
                                    ("pipeline_parallel", {"num_microbatches": 4})])
    # compiled: refused with the fix, not left to fail inside dynamo at the first step
    try:
        train_loop_model([("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_microbatches": 4}),
                          ("native_dynamo", {"backend": "eager"})], steps=1)
        out["compiled"] = "trained"
    except NotSupportedError as error:
        out["compiled"] = str(error)
    # a forward that branches on data: refused on every rank, none left waiting
    model = PipelineModel(loop_model(stop_on_data=True), num_microbatches=2, auto_partition=True, loss_fn=chain_loss)
    x, y = batches()[0]
    with pytest.raises(NotSupportedError) as refused:
        model.run_train(x=x, target=y)
    out["refused"] = str(refused.value)
    return out


def _record_held_outputs(stage, held: list) -> None:
    """Before each backward, append the bytes of the stage's sent outputs that something still
    references (the storages are kept here too; a use count above 1 means someone else holds one)."""
    send, backward, sent = stage.get_fwd_send_ops, stage.backward_one_chunk, []

    def sending(chunk):
        ops = send(chunk)
        sent.extend(op.tensor.untyped_storage() for op in ops)
        return ops

    def recorded(*args, **kwargs):
        held.append(sum(s.nbytes() for s in sent if torch._C._storage_Use_Count(s._cdata) > 1))
        return backward(*args, **kwargs)

    stage.get_fwd_send_ops, stage.backward_one_chunk = sending, recorded


@pytest.fixture(scope="module")
def traced_two_ranks():
    return run_distributed(_two_rank_traced_runs, 2)


def test_modulelist_model_by_cuts_and_auto_matches_serial(traced_two_ranks):
    reference = serial_losses_of(loop_model())
    first, last = traced_two_ranks
    for case in ("cuts", "interleaved"):
        assert first[case]["losses"] == last[case]["losses"]
        assert_losses_close(first[case]["losses"], reference, FP32_RTOL)
    # negative control: the comparison tells a model that did not train from one that did
    assert_sensitive(first["cuts"]["losses"], {"lr=0": serial_losses_of(loop_model(), lr=0.0)}, FP32_RTOL)
    assert first["cuts"]["units"] == ["embed", "blocks.0", "blocks.1"]
    assert last["cuts"]["units"] == ["blocks.2", "blocks.3", "head"]
    # 4 stages of one block each (embed and head join the first and last): rank r runs stages r, r + 2
    assert first["interleaved"]["units"] == ["embed", "blocks.0", "blocks.2"]
    assert last["interleaved"]["units"] == ["blocks.1", "blocks.3", "head"]


def test_pipeline_parallel_method_splits_the_modulelist_model(traced_two_ranks):
    for rank in traced_two_ranks:
        assert rank["auto"]["args"]["backward_in_forward"] is True
        assert_losses_close(rank["auto"]["losses"], serial_losses_of(loop_model()), FP32_RTOL)


def test_gpt2_and_bert_with_tied_heads_match_serial(traced_two_ranks):
    from tests.helpers.hf import tiny_bert, tiny_gpt2

    first, last = traced_two_ranks
    for name, build, masked in (("gpt2", tiny_gpt2, False), ("bert", tiny_bert, True)):
        reference = hf_serial_losses(build(), masked=masked)
        assert first[name]["losses"] == last[name]["losses"]
        assert_losses_close(first[name]["losses"], reference, FP32_RTOL)
        assert_sensitive(first[name]["losses"], {"lr=0": hf_serial_losses(build(), masked=masked, lr=0.0)},
                         FP32_RTOL)
        # the embedding on stage 0, the head tied to it on stage 1: after training, the same weights
        (embed,), (head,) = first[name]["tied"], last[name]["tied"]
        assert torch.equal(embed, head)
        serial = build()
        hf_serial_losses(serial, masked=masked)
        tied = serial.get_output_embeddings().weight
        assert torch.allclose(head, tied, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(head, build().get_output_embeddings().weight, rtol=1e-4, atol=1e-6)


def test_a_traced_pipeline_is_not_compiled_and_the_refusal_names_the_fix(traced_two_ranks):
    for rank in traced_two_ranks:
        assert rank["compiled"].startswith("native_dynamo cannot compile a pipeline split by tracing")
        assert "register_layout" in rank["compiled"]


def test_data_dependent_forward_is_refused_on_every_rank(traced_two_ranks):
    for rank in traced_two_ranks:
        assert "cannot trace LoopNet's forward" in rank["refused"] and "h.abs().max() > 100" in rank["refused"]


def _four_rank_traced_runs():
    """pipeline 2 x data 2: the ModuleList model with SGD, with AdamW plain and ZeRO-1, and GPT-2."""
    from atorch.distributed.topology import Topology
    from atorch.pipeline import PipelineModel
    from tests.helpers.hf import tiny_gpt2

    topology = Topology.build([("pipeline", 2), ("data", 2)])
    share = slice(topology.data_parallel_rank * 4, topology.data_parallel_rank * 4 + 4)
    out = {}
    for name, optimizer, zero1 in (("sgd", torch.optim.SGD, False), ("adamw", torch.optim.AdamW, False),
                                   ("adamw_zero1", torch.optim.AdamW, True)):
        model = PipelineModel(loop_model(), num_microbatches=2, auto_partition=True, loss_fn=chain_loss,
                              broadcast_and_average_loss=True, topology=topology, use_zero1_optimizer=zero1)
        optim = model.make_optimizer(optimizer, lr=LR)
        losses = []
        for x, y in batches():
            losses.append(model.run_train(x=x[share], target=y[share]).item())
            optim.step()
            optim.zero_grad()
        state = optim.optim.state if zero1 else optim.state
        out[name] = {"losses": losses, "state_numel": sum(t.numel() for s in state.values() for t in s.values()
                                                          if isinstance(t, torch.Tensor) and t.ndim > 0)}
    model = PipelineModel(tiny_gpt2(), num_microbatches=2, auto_partition=True, broadcast_and_average_loss=True,
                          topology=topology)
    optim = torch.optim.SGD(model.local_parameters(), lr=LR)
    losses = []
    for batch in token_batches():
        losses.append(model.run_train(**{k: v[share] for k, v in batch.items()}).item())
        optim.step()
        optim.zero_grad()
    out["gpt2"] = {"losses": losses}
    return out


@pytest.mark.slow  # the default suite stays under 15 minutes; run with -m slow
def test_pipeline_2_x_data_2_and_zero1_match_serial():
    from tests.helpers.hf import tiny_gpt2

    results = run_distributed(_four_rank_traced_runs, 4, timeout_s=400)
    references = {"sgd": serial_losses_of(loop_model()),
                  "adamw": serial_losses_of(loop_model(), optimizer=torch.optim.AdamW),
                  "gpt2": hf_serial_losses(tiny_gpt2())}
    references["adamw_zero1"] = references["adamw"]
    for name, reference in references.items():
        for rank in results:
            assert rank[name]["losses"] == results[0][name]["losses"]
        assert_losses_close(results[0][name]["losses"], reference, FP32_RTOL)
    assert_sensitive(results[0]["adamw_zero1"]["losses"], {"sgd": references["sgd"]}, FP32_RTOL)
    # ZeRO-1: each data rank keeps about half of its stage's optimizer state
    for rank in results:
        ratio = rank["adamw_zero1"]["state_numel"] / rank["adamw"]["state_numel"]
        assert 0.3 < ratio < 0.7, ratio


def test_traced_stage_programs_compute_the_model():
    """Each stage's program, bound to the model's parameters and run in turn, gives the model's
    output: GPT-2 with a padding attention_mask as a traced input, and BERT masked LM."""
    from atorch.pipeline.partition import balanced_ranges
    from tests.helpers.hf import tiny_bert, tiny_gpt2

    ids = token_batches(1)[0]["input_ids"][:2]
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0
    for build, inputs in ((tiny_gpt2, {"input_ids": ids, "attention_mask": mask}), (tiny_bert, {"input_ids": ids})):
        model = build()
        layout = layout_for(model, list(inputs))
        ranges = balanced_ranges(model, layout.units, layout.layer_units, 2)
        pipe = layout.trace(tuple(inputs.values()), ranges)
        first, last = (layout.bind(pipe, i, ranges, torch.device("cpu")) for i in range(2))
        sent = first(*inputs.values())
        output = layout.model_output(last(*sent), {"labels": ids})
        reference = model(**inputs, labels=ids)
        assert torch.equal(output.logits, reference.logits)
        assert output.loss.item() == pytest.approx(reference.loss.item(), rel=1e-6)
        assert not torch.equal(output.logits, build(seed=1)(**inputs).logits)  # control: another model differs


def test_untraceable_or_unrunnable_programs_are_refused_with_the_fix():
    from tests.pipeline.models import NoGradTableModel

    reason = pipeline_eligibility(NoGradTableModel(), 2, {"input_ids": torch.randint(0, 16, (2, 6))})
    assert "the program cut into stages does not run" in reason and "a layout" in reason
    # control: the same model, its table outside no_grad, runs cut
    runnable = NoGradTableModel()
    runnable.table.forward = type(runnable.table).forward.__wrapped__.__get__(runnable.table)
    assert pipeline_eligibility(runnable, 2, {"input_ids": torch.randint(0, 16, (2, 6))}) is None


def test_a_wrapped_llama_is_traced_into_stages_equal_to_the_model_or_refused_with_the_fix():
    import transformers
    from packaging.version import Version
    from transformers import LlamaConfig, LlamaForCausalLM

    from atorch.pipeline.partition import balanced_ranges
    from tests.pipeline.models import HiddenLayout

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    assert pipeline_eligibility(lm, 2) is None  # through its layout
    wrapped = HiddenLayout(lm)
    reason = pipeline_eligibility(wrapped, 2)
    if Version(transformers.__version__) < Version("5.24"):  # rotary_emb's forward ran under no_grad
        assert "the program cut into stages does not run" in reason and "a layout" in reason
        return
    assert reason is None
    ids = torch.randint(0, 64, (2, 8))
    layout = layout_for(wrapped, ["input_ids"])
    ranges = balanced_ranges(wrapped, layout.units, layout.layer_units, 2)
    pipe = layout.trace((ids,), ranges)
    first, last = (layout.bind(pipe, i, ranges, torch.device("cpu")) for i in range(2))
    assert torch.equal(layout.model_output(last(*first(ids)), {}).logits, wrapped(ids).logits)


def test_deallocate_pipeline_outputs_frees_sent_outputs_and_trains_the_same(traced_two_ranks):
    first, last = traced_two_ranks
    output_bytes = 2 * HIDDEN * 4  # one microbatch's stage output: 2 rows of 16 floats
    for name in ("1f1b", "traced", "gpipe"):
        kept, freed = first[f"dealloc_{name}_False"], first[f"dealloc_{name}_True"]
        # the first step is the fixture's own; the next four continue it, equal with and without freeing
        assert freed["losses"] == kept["losses"]
        assert kept["held"] >= 2 * output_bytes  # 1F1B's stage 0 keeps 2 microbatches in flight, GPipe 4
        assert last[f"dealloc_{name}_True"]["held"] == 0  # the last stage sends nothing
    for name in ("1f1b", "traced"):
        # 1F1B: only the (at most two) sends torch's schedule still holds keep an output alive
        freed, kept = first[f"dealloc_{name}_True"]["held"], first[f"dealloc_{name}_False"]["held"]
        assert freed <= 2 * output_bytes < kept, (freed, kept)
    # GPipe: torch's schedule keeps every send handle (holding the sent tensor) until its forward
    # phase ends, so freeing saves nothing there
    assert first["dealloc_gpipe_True"]["held"] == first["dealloc_gpipe_False"]["held"] == 4 * output_bytes


def test_a_7b_model_on_meta_splits_into_8_stages_without_memory():
    """A 6.7B-parameter GPT-2 built on the meta device: traced, cut into 8 stages and the stages'
    programs run in turn, all on meta (about 8 s, a few hundred MiB of process memory)."""
    import resource

    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=2048, n_embd=4096, n_layer=32, n_head=32))
    assert sum(p.numel() for p in model.parameters()) > 6.5e9
    assert pipeline_eligibility(model, 8) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20  # KiB: far below the model's 27 GB


def test_encoder_decoder_is_refused_with_the_fix_and_its_logits_wrapper_traces():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                      use_cache=False)
    reason = pipeline_eligibility(T5ForConditionalGeneration(config), 2)
    assert "T5ForConditionalGeneration is an encoder-decoder model" in reason and "decoder_input_ids" in reason

    class LogitsOnly(torch.nn.Module):  # the fix the message gives
        def __init__(self):
            super().__init__()
            self.t5 = T5ForConditionalGeneration(config)

        def forward(self, input_ids, decoder_input_ids):
            return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits

    ids = torch.zeros(1, 8, dtype=torch.long)
    assert pipeline_eligibility(LogitsOnly(), 2, {"input_ids": ids, "decoder_input_ids": ids}) is None
    # with one of its two inputs the forward raises: the reason says to name every input
    reason = pipeline_eligibility(LogitsOnly(), 2, {"input_ids": ids})
    assert "raised TypeError" in reason and "name every input the forward needs" in reason
