"""fsdp and zero2 beside a pipeline (issue 54, point 5): pipeline=2 x data=2, each stage sharded by
FSDP2 over its data ranks, against the serial run of the same tiny Llama, data and global batch
(padded batches: tests/auto/composition.py), its compute dtype asserted and its checkpoint round
trip checked; a tied embedding and head across the two stages; and the search's refusal on a
pipeline split by tracing."""

import pytest
import torch

from tests.auto import composition as C
from tests.auto.test_composition import check
from tests.helpers.dist import run_distributed

CASES = [("fsdp", "pipeline_parallel"), ("pipeline_parallel", "zero2"), ("amp_native", "fsdp", "pipeline_parallel")]


def test_fsdp_and_zero2_shard_each_stage_and_train_as_the_serial_model(tmp_path):
    cases = [case for case in CASES if C.plan_case(case, 4)["outcome"] == "accepted"]
    assert cases == CASES
    results = run_distributed(C.run_cases, 4, cases, 4, str(tmp_path), timeout_s=600)
    problems = check(results[0], 4)
    assert not problems, "\n\n".join(problems)


def _tied_llama_and_data():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                         tie_word_embeddings=True))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": row, "labels": row} for row in ids]


def _tied_llama(fsdp: bool) -> dict:
    """A Llama whose head is its embedding (embedding on stage 0, head on stage 1) under fsdp or
    zero1 beside the pipeline, stepped by SGD (which, unlike AdamW, a gradient's scale moves): its
    losses, and whether the stages' parameters are DTensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import atorch

    model, data = _tied_llama_and_data()
    strategy = [("parallel_mode", {"dims": [["pipeline", 2], ["data", 2]]}),
                ("pipeline_parallel", {"num_microbatches": 2}), "fsdp" if fsdp else "zero1"]
    status, result, _ = atorch.auto_accelerate(model, torch.optim.SGD, data, lambda batch, out: out.loss,
                                               optim_args={"lr": 0.5}, load_strategy=strategy,
                                               dataloader_args={"batch_size": 8, "shuffle": False},
                                               model_input_format="unpack_dict")
    assert status
    losses = []
    for _ in range(STEPS):
        batch = next(iter(result.dataloader))
        loss = result.model(**result.prepare_input(batch, atorch.device()))
        result.backward(loss)
        result.step()
        losses.append(float(loss))
    sharded = all(isinstance(p, DTensor) for p in result.model.parameters())
    dist.barrier()
    return {"losses": losses, "sharded": sharded}


STEPS = 3


def _serial_losses() -> list[float]:
    model, data = _tied_llama_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = {key: torch.stack([row[key] for row in data]) for key in data[0]}
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def test_a_tied_embedding_and_head_on_two_sharded_stages_trains_as_the_serial_model():
    # the tied weight's gradient is summed over its two stages' copies, here over their local shards;
    # SGD: a gradient off by the data ranks' count (AdamW would not see it) moves the losses 4%
    serial = _serial_losses()
    runs = run_distributed(_tied_llama, 4, True, timeout_s=300)
    assert all(r["sharded"] for r in runs)
    for run in runs:
        assert run["losses"] == pytest.approx(serial, rel=1e-5), (run["losses"], serial)
    assert serial[-1] < serial[0]


@pytest.mark.slow  # zero1 x pipeline is in the composition matrix (AdamW); here under SGD too
def test_a_tied_embedding_and_head_under_zero1_beside_the_pipeline_trains_as_the_serial_model():
    serial = _serial_losses()
    for run in run_distributed(_tied_llama, 4, False, timeout_s=300):
        assert not run["sharded"] and run["losses"] == pytest.approx(serial, rel=1e-5)


def test_fsdp_and_zero2_are_ineligible_on_a_traced_pipeline_and_name_what_composes():
    from types import SimpleNamespace

    from atorch.sharding.fsdp2 import TRACED_PIPELINE, pipeline_ineligible

    class Branchy(torch.nn.Module):  # no layout knows it: a pipeline would trace it
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    assert pipeline_ineligible(Branchy(), None, SimpleNamespace(dims={"pipeline": 2, "data": 2})) == TRACED_PIPELINE
    assert pipeline_ineligible(Branchy(), None, SimpleNamespace(dims={"data": 4})) is None
    assert "zero1" in TRACED_PIPELINE and "register_layout" in TRACED_PIPELINE
