"""expert_parallel on experts held as a ModuleList beside a router (issue 55, point 2: the
generic shape, recognized by structure; its routing checked against the block's own forward,
anything else refused with the reason), and its capacity factor (point 1)."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed

STEPS = 3
EP = ["parallel_mode", "expert_parallel"]


def _train(strategy: list, listed: bool = True) -> dict:
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens
    from tests.helpers.moe import listed_mixtral
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    model = listed_mixtral() if listed else tiny_moe("mixtral")
    _, result, _ = auto_accelerate(model, torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=strategy)
    losses, batches, dropped = [], iter(result.dataloader), []
    for _ in range(STEPS):
        batch = result.prepare_input(next(batches), torch.device("cpu"))
        result.backward(result.loss_func(batch, result.model(**batch)))
        result.step()
        losses.append(result.last_step.loss)
        dropped.append(_dropped(result.model))
    model = getattr(result.model, "module", result.model)
    held = sorted({name.split(".experts.")[1].split(".")[0] for name, p in model.named_parameters()
                   if getattr(p, "expert_parallel", False)})
    return {"losses": losses, "held": held, "dropped": dropped}


def _dropped(model) -> int:
    from atorch.parallel_layers.expert_dispatch import Dispatch

    found = [m.forward.experts for m in model.modules() if isinstance(getattr(m.forward, "experts", None), Dispatch)]
    found += [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), Dispatch)]
    return sum(d.dropped for d in found)


def test_a_modulelist_block_is_computed_as_its_own_forward_computes_it():
    pytest.importorskip("transformers")
    from atorch.parallel_layers.expert_list import match_block
    from tests.helpers.moe import ListedMoeBlock, SigmoidRoutedBlock, listed_mixtral
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    fused, listed = tiny_moe("mixtral"), listed_mixtral()  # the same weights, two shapes
    assert listed(input_ids=ids, labels=ids).loss.item() == pytest.approx(fused(input_ids=ids, labels=ids).loss.item())
    block = ListedMoeBlock(32, 64, 4, 2, tuple_out=True)  # transformers 4's (output, router logits)
    routed, why = match_block(block, block.experts, None)
    assert why is None and routed.returns_logits and routed.normalize
    refused = SigmoidRoutedBlock(32, 64, 4, 2)
    assert match_block(refused, refused.experts, None)[0] is None
    assert "is not a softmax top-2 routing" in match_block(refused, refused.experts, None)[1]


def _refused() -> str:
    from atorch.auto import auto_accelerate
    from atorch.errors import MethodConfigError
    from tests.helpers.moe import SigmoidRoutedBlock, listed_mixtral

    try:
        auto_accelerate(listed_mixtral(SigmoidRoutedBlock), torch.optim.AdamW, load_strategy=EP)
    except MethodConfigError as error:
        return str(error)
    return "accepted"


def test_a_block_routed_otherwise_is_refused_with_the_reason():
    pytest.importorskip("transformers")
    said = run_distributed(_refused, 2)[0]
    assert "model.layers.0.mlp.experts" in said and "is not a softmax top-2 routing" in said, said


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_modulelist_experts_train_as_the_single_process(world):
    """Each rank holds its experts' modules only (the others are empty placeholders, the kept
    ones keep their names) and the losses equal the single process's at fp32 1e-5."""
    pytest.importorskip("transformers")
    serial = run_distributed(_train, 1, [])[0]
    ranks = run_distributed(_train, world, EP)
    share = 4 // world
    assert [rank["held"] for rank in ranks] == [[str(e) for e in range(r * share, (r + 1) * share)]
                                                for r in range(world)]
    assert ranks[0]["losses"] == pytest.approx(serial["losses"], rel=1e-5)


def test_the_capacity_keeps_the_first_pairs_of_each_expert_in_token_order():
    from atorch.parallel_layers.expert_dispatch import capacity_keep

    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # 8 pairs over 4 experts
    # factor 1: capacity 2 a expert; expert 0's third and fourth pairs (tokens 2 and 3) dropped
    assert capacity_keep(chosen, 4, 1.0).tolist() == [True, True, True, True, False, True, True, False]
    assert capacity_keep(chosen, 4, 2.0).all()


def test_a_capacity_factor_drops_the_overflow_and_a_large_one_drops_nothing():
    """Fused experts on 2 ranks: with room for every pair (factor 4 with 4 experts), the serial
    losses; with factor 0.5 the overflowing pairs are dropped (counted on each rank) and the
    losses move, as they must."""
    pytest.importorskip("transformers")
    serial = run_distributed(_train, 1, [], False)[0]
    roomy = run_distributed(_train, 2, ["parallel_mode", ("expert_parallel", {"capacity_factor": 4.0})], False)[0]
    assert roomy["losses"] == pytest.approx(serial["losses"], rel=1e-5) and roomy["dropped"] == [0] * STEPS
    tight = run_distributed(_train, 2, ["parallel_mode", ("expert_parallel", {"capacity_factor": 0.5})], False)[0]
    assert all(dropped > 0 for dropped in tight["dropped"]), tight
    assert tight["losses"] != pytest.approx(serial["losses"], rel=1e-3)


def _save(directory: str) -> list[float]:
    import atorch.checkpoint as ckpt
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens
    from tests.helpers.moe import listed_mixtral

    _, result, _ = auto_accelerate(listed_mixtral(), torch.optim.AdamW, CountingTokens(), lambda b, out: out.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=EP if dist.is_initialized() else [])
    if directory.endswith("load"):  # the untrained model: only what it loads can match
        ckpt.load(directory[:-len("load")], result.model, result.optim)
    else:
        batches = iter(result.dataloader)
        for _ in range(2):
            batch = result.prepare_input(next(batches), torch.device("cpu"))
            result.backward(result.loss_func(batch, result.model(**batch)))
            result.step()
        ckpt.save(directory, result.model, result.optim)
    ids = torch.arange(32).reshape(2, 16) * 7 % 96  # the same batch on every rank and in one process
    with torch.no_grad():
        return [result.model(input_ids=ids, labels=ids).loss.item()]


@pytest.mark.slow  # -m slow; by default: tests/checkpoint/test_expert_resume.py loads slices elsewhere
def test_a_checkpoint_of_modulelist_experts_loads_in_one_process(tmp_path):
    """Each rank writes its own experts under their names; one process reads them all back."""
    pytest.importorskip("transformers")
    directory = str(tmp_path / "ck")
    saved = run_distributed(_save, 2, directory, fresh=True)[0]
    loaded = run_distributed(_save, 1, directory + "load")[0]
    assert loaded == pytest.approx(saved, rel=1e-5)
