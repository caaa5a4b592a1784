"""Issue 56: a GPT-2 (tied embedding and head) saved under fsdp resumes under pipeline=2, in new
processes. fsdp keeps the tie as one tensor and saves its optimizer state under one name; the
pipeline keeps a copy on each stage, under each name, and the load refused with "has no
optimizer state ['optim.param_groups.lm_head.weight.amsgrad', ...]". The state saved under one
name now fills every copy: the resumed run continues as the uninterrupted one does (fp32 1e-5)."""

import pytest

from tests.helpers.dist import run_distributed

PIPELINE = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_microbatches": 2})]


def save_under_fsdp(directory: str) -> list[float]:
    import atorch.checkpoint as ckpt
    from tests.checkpoint.jobs import train
    from tests.checkpoint.runs import build_gpt2

    result = build_gpt2(["parallel_mode", "fsdp"])
    train(result, 2)
    ckpt.save(directory, result.model, result.optim)
    return train(result, 2)  # the uninterrupted run's next two steps


def load_under_pipeline(directory: str) -> list[float]:
    import atorch.checkpoint as ckpt
    from tests.checkpoint.jobs import train
    from tests.checkpoint.runs import build_gpt2

    result = build_gpt2(PIPELINE)
    ckpt.load(directory, result.model, result.optim)
    return train(result, 2)


@pytest.mark.slow  # -m slow; by default: the resume matrix resumes a tied Llama under each strategy
def test_a_tied_gpt2_saved_under_fsdp_resumes_under_a_pipeline(tmp_path):
    pytest.importorskip("transformers")
    uninterrupted = run_distributed(save_under_fsdp, 2, str(tmp_path / "ck"), fresh=True)[0]
    resumed = run_distributed(load_under_pipeline, 2, str(tmp_path / "ck"), fresh=True)[0]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)
