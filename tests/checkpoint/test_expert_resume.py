"""A checkpoint of a job under expert_parallel holds the whole experts (each rank's slice, stored
as one weight split over the expert group): saved on 2 ranks after 2 steps, it loads in new
processes under expert_parallel and under ddp, and in one process, and each continues as the
uninterrupted run does (fp32, 1e-5). Saved under expert_parallel with fsdp, it loads under the
same and under fsdp alone."""

import pytest
import torch

from tests.helpers.dist import run_distributed

EP = ["parallel_mode", "expert_parallel"]
EP_FSDP = ["parallel_mode", "fsdp", "expert_parallel"]


def _build(strategy):
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    _, result, _ = auto_accelerate(tiny_moe("mixtral"), torch.optim.AdamW, CountingTokens(),
                                   lambda batch, out: out.loss, optim_args={"lr": 1e-2},
                                   dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                                   load_strategy=strategy)
    return result


def _steps(result, count: int, batches=None) -> list[float]:
    losses, batches = [], batches or iter(result.dataloader)
    for _ in range(count):
        batch = result.prepare_input(next(batches), torch.device("cpu"))
        result.backward(result.loss_func(batch, result.model(**batch)))
        result.step()
        losses.append(result.last_step.loss)
    return losses


def save_and_continue(directory: str, strategy: list = EP) -> list[float]:
    import atorch.checkpoint as ckpt

    result = _build(strategy)
    batches = iter(result.dataloader)  # one epoch's iterator throughout, as a training loop keeps it
    _steps(result, 2, batches)
    ckpt.save(directory, result.model, result.optim, dataloader=result.dataloader)
    return _steps(result, 2, batches)


def load_and_continue(directory: str, strategy: list) -> list[float]:
    import atorch.checkpoint as ckpt

    torch.manual_seed(3)
    result = _build(strategy)
    ckpt.load(directory, result.model, result.optim, dataloader=result.dataloader)
    return _steps(result, 2)


@pytest.mark.slow  # the default run resumes EP x FSDP in new processes and round-trips ep in the matrix
@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_checkpoint_under_expert_parallel_resumes_under_any_strategy(tmp_path, elsewhere):
    """Under expert_parallel again; under ddp and in one process too."""
    pytest.importorskip("transformers")
    directory = str(tmp_path / "ck")
    uninterrupted = run_distributed(save_and_continue, 2, directory, fresh=True)[0]
    for strategy in ([["parallel_mode"]] if elsewhere else [EP]):
        resumed = run_distributed(load_and_continue, 2, directory, strategy, fresh=True)[0]
        assert resumed == pytest.approx(uninterrupted, rel=1e-5), strategy
    if elsewhere:
        assert run_distributed(load_and_continue, 1, directory, [])[0] == pytest.approx(uninterrupted, rel=1e-5)


@pytest.mark.slow  # the default run resumes EP x FSDP on fewer ranks (below) and round-trips it in the matrix
@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_checkpoint_under_expert_parallel_and_fsdp_resumes(tmp_path, elsewhere):
    """The experts' slices (plain tensors split over the expert group) beside fsdp's sharded
    weights: under the same strategy by default; with -m slow under fsdp alone."""
    pytest.importorskip("transformers")
    directory = str(tmp_path / "ck")
    uninterrupted = run_distributed(save_and_continue, 2, directory, EP_FSDP, fresh=True)[0]
    strategy = ["parallel_mode", "fsdp"] if elsewhere else EP_FSDP
    resumed = run_distributed(load_and_continue, 2, directory, strategy, fresh=True)[0]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5), strategy


def test_a_checkpoint_of_slices_sharded_over_their_copies_loads_on_fewer_ranks(tmp_path):
    """EP x FSDP on 4 ranks (groups of 2: fsdp shards each slice over the 2 ranks that hold it),
    loaded under expert_parallel with fsdp on 2 ranks: the same continuation."""
    pytest.importorskip("transformers")
    directory = str(tmp_path / "ck")
    source = ["parallel_mode", "fsdp", ("expert_parallel", {"size": 2})]
    uninterrupted = run_distributed(save_and_continue, 4, directory, source, fresh=True)[0]
    resumed = run_distributed(load_and_continue, 2, directory, EP_FSDP, fresh=True)[0]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)


@pytest.mark.slow  # -m slow; by default: slices load on fewer ranks below
@pytest.mark.parametrize("in_one_process", [False, True])
def test_a_checkpoint_under_zero1_beside_expert_parallel_loads_elsewhere(tmp_path, in_one_process):
    """zero1 beside expert_parallel on 4 ranks (groups of 2): each rank writes the state of the
    shared weights it owns and of its own experts' slices; loaded under expert_parallel on 2 ranks
    (with -m slow, in one process), it continues as the uninterrupted run does."""
    pytest.importorskip("transformers")
    directory = str(tmp_path / "ck")
    source = ["parallel_mode", "zero1", ("expert_parallel", {"size": 2})]
    uninterrupted = run_distributed(save_and_continue, 4, directory, source, fresh=True)[0]
    if in_one_process:
        resumed = run_distributed(load_and_continue, 1, directory, [])[0]
    else:
        resumed = run_distributed(load_and_continue, 2, directory, EP, fresh=True)[0]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)
