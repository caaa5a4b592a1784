"""Issue 51 under the trainer integrations: on padded batches, AtorchTrainer, AtorchStrategy and
AtorchFabricStrategy train exactly as plain PyTorch on each whole global batch.

2 gloo ranks, a tiny Llama (BERT's masked LM and GPT-2 for the Trainer's counting), fp32, 4 SGD
steps over global batches of 8 right-padded sequences (2 to 16 label tokens each), split over the
data ranks and 1 or 2 accumulation micro-batches (tests/integrations/padded_runs.py). Compared
with the serial run: each step's loss (the global batch's token mean: the Trainer's logged loss;
for Lightning and Fabric every rank's parts summed) and the weights after, relative to how far the
serial run moved them. Measured at the change that added this file: exact runs 0.9e-7 to 2.1e-7
(losses) and 2.2e-7 to 5.3e-7 (weights) apart; the negative controls (a mean of per-part means, or
a count off by a token a row) 1.1e-3 to 3.3 (losses) and 0.11 to 4.4 (weights).
"""

import pytest

from tests.helpers.dist import run_distributed
from tests.integrations import padded_runs as runs

pytest.importorskip("transformers", minversion="5.0")

TOL = 1e-5  # fp32: the losses relative, the weights relative to the serial run's change
TP2 = [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"]


def gaps(run: dict, reference: dict) -> tuple[float, float]:
    return runs.loss_gap(run["losses"], reference), runs.relative_change_error(run["after"], reference)


def assert_exact(run: dict, reference: dict) -> None:
    loss_gap, weight_gap = gaps(run, reference)
    assert loss_gap <= TOL and weight_gap <= TOL, (loss_gap, weight_gap, run["losses"], reference["losses"])


def assert_off(run: dict, reference: dict) -> None:
    """A negative control: the comparison that passes above would fail this run."""
    loss_gap, weight_gap = gaps(run, reference)
    assert loss_gap > 10 * TOL and weight_gap > 1000 * TOL, (loss_gap, weight_gap)


def _run_all(train, tmp: str, cases: dict) -> dict:
    return {name: train(f"{tmp}/{i}", **kwargs) for i, (name, kwargs) in enumerate(cases.items())}


@pytest.fixture(scope="module")
def references():
    return {family: runs.serial(family) for family in ("llama", "bert", "gpt2")}


def assert_the_empty_step_is_skipped(run: dict, reference: dict) -> None:
    """Step 1's global batch counts no label: no update (as the serial run, which skips it),
    nothing divided by zero, one WARNING."""
    assert_exact(run, reference)
    assert len(run["warnings"]) == 1 and "no counted label" in run["warnings"][0], run["warnings"]


# The splits both trainers run against the serial run.
SPLITS = {
    "ddp": dict(strategy=["parallel_mode"]),
    "ddp x accumulation 2": dict(strategy=["parallel_mode"], accumulation=2),
    "fsdp x accumulation 2": dict(strategy=["fsdp"], accumulation=2),
    "zero1 x accumulation 2": dict(strategy=["zero1"], accumulation=2),
    "zero2 x accumulation 2": dict(strategy=["zero2"], accumulation=2),
    "tensor_parallel x accumulation 2": dict(strategy=TP2, accumulation=2, data_size=1),
}

# The Hugging Face Trainer: AtorchTrainer against the serial run, and what the plain Trainer does.

HF = {
    **SPLITS,
    "bert ddp x accumulation 2": dict(strategy=["parallel_mode"], accumulation=2, family="bert"),
    "gpt2 ddp x accumulation 2": dict(strategy=["parallel_mode"], accumulation=2, family="gpt2"),
    # The plain Trainer (the controls and what it does itself).
    "plain llama x accumulation 2": dict(plain=True, accumulation=2),
    "plain per-rank mean": dict(plain=True, accumulation=2, average_tokens=False),
    "plain bert": dict(plain=True, accumulation=2, family="bert"),
    "plain gpt2": dict(plain=True, accumulation=2, family="gpt2"),
    "atorch per-rank mean": dict(strategy=["parallel_mode"], accumulation=2, average_tokens=False),
    "empty step": dict(strategy=["parallel_mode"], accumulation=2, empty=1),
}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    return run_distributed(_run_all, 2, runs.train_hf, str(tmp_path_factory.mktemp("hf_padded")), HF,
                           timeout_s=300)[0]


def _family(name: str) -> str:
    return next((family for family in ("bert", "gpt2") if family in name), "llama")


@pytest.mark.parametrize("name", [name for name in HF if not name.startswith(("plain", "atorch per", "empty"))])
def test_atorch_trainer_trains_on_the_global_batchs_token_mean(hf_runs, references, name):
    run = hf_runs[name]
    assert_exact(run, references[_family(name)])
    assert run["warnings"] == []


def test_the_plain_trainer_is_exact_only_where_it_counts_as_the_model_does(hf_runs, references):
    """transformers 5.24: with average_tokens_across_devices=True (its default) the Trainer counts
    the step's label tokens over the ranks and accumulation, the model divides by that count and
    the loss is multiplied by the ranks; exact for Llama. Not for heads that drop
    num_items_in_batch (BERT's masked LM: a loss inflated by the ranks and micro-batches), nor for
    GPT-2, whose loss_type it cannot read (it counts each row's first label too)."""
    assert_exact(hf_runs["plain llama x accumulation 2"], references["llama"])
    assert_off(hf_runs["plain bert"], references["bert"])
    assert_off(hf_runs["plain gpt2"], references["gpt2"])


def test_average_tokens_across_devices_false_is_each_ranks_mean(hf_runs, references):
    """The explicit choice: each data rank's share weighs as one, in the plain Trainer and in
    AtorchTrainer alike, with a WARNING once that names it."""
    plain, atorch_run = hf_runs["plain per-rank mean"], hf_runs["atorch per-rank mean"]
    assert_off(plain, references["llama"])
    assert runs.loss_gap(atorch_run["losses"], {"losses": plain["losses"]}) <= TOL
    assert len(atorch_run["warnings"]) == 1 and "average_tokens_across_devices=False" in atorch_run["warnings"][0]


def test_atorch_trainer_skips_a_step_without_labels(hf_runs):
    assert_the_empty_step_is_skipped(hf_runs["empty step"], runs.serial("llama", empty=1))


# Lightning: AtorchStrategy weights the loss training_step returns.

LIGHTNING = {
    **SPLITS,
    "with_count x accumulation 2": dict(strategy=["parallel_mode"], accumulation=2, with_count=True),
    "lightning ddp": dict(accumulation=2),
    "per_part_mean": dict(strategy=["parallel_mode"], accumulation=2, normalization="per_part_mean"),
    "empty step": dict(strategy=["parallel_mode"], accumulation=2, empty=1),
}


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning")
    return run_distributed(_run_all, 2, runs.train_lightning, str(tmp_path_factory.mktemp("lightning_padded")),
                           LIGHTNING, timeout_s=300)[0]


@pytest.fixture(scope="module")
def lightning_reference():
    return runs.serial("llama", order=runs.lightning_order())


@pytest.mark.parametrize("name", list(LIGHTNING)[:7])
def test_atorch_strategy_trains_on_the_global_batchs_token_mean(lightning_runs, lightning_reference, name):
    run = lightning_runs[name]
    assert_exact(run, lightning_reference)
    assert run["warnings"] == []


def test_lightning_alone_trains_on_a_mean_of_means(lightning_runs, lightning_reference):
    """Lightning's DDP, and AtorchStrategy(loss_normalization="per_part_mean"): each rank's and
    accumulated batch's mean weighs as one."""
    assert_off(lightning_runs["lightning ddp"], lightning_reference)
    assert_off(lightning_runs["per_part_mean"], lightning_reference)
    assert lightning_runs["per_part_mean"]["warnings"] == []


def test_atorch_strategy_skips_a_step_without_labels(lightning_runs):
    assert_the_empty_step_is_skipped(lightning_runs["empty step"],
                                     runs.serial("llama", order=runs.lightning_order(), empty=1))


# Fabric: AtorchFabricStrategy weights what fabric.backward gets.

FABRIC = {
    "ddp": dict(strategy=["parallel_mode"]),
    "ddp x accumulation 2": dict(strategy=["parallel_mode"], accumulation=2),
    "fsdp x accumulation 2": dict(strategy=["fsdp"], accumulation=2),
    "tensor_parallel x accumulation 2": dict(strategy=TP2, accumulation=2, data_size=1),
    "fabric ddp, loss / accumulation": dict(accumulation=2, divide=True),
    "atorch, loss / accumulation": dict(strategy=["parallel_mode"], accumulation=2, divide=True),
    "empty step": dict(strategy=["parallel_mode"], accumulation=2, empty=1),
}


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    pytest.importorskip("lightning")
    return run_distributed(_run_all, 2, runs.train_fabric, str(tmp_path_factory.mktemp("fabric_padded")), FABRIC,
                           timeout_s=300)[0]


@pytest.mark.parametrize("name", list(FABRIC)[:4])
def test_atorch_fabric_strategy_trains_on_the_global_batchs_token_mean(fabric_runs, references, name):
    run = fabric_runs[name]
    assert_exact(run, references["llama"])
    assert run["warnings"] == []


def test_a_divided_loss_keeps_the_loops_own_weighting_and_says_so(fabric_runs, references):
    """loss / accumulation is not the model's loss: AtorchFabricStrategy leaves it as Fabric's DDP
    does (a mean of means) and warns once, naming the fix."""
    assert_off(fabric_runs["fabric ddp, loss / accumulation"], references["llama"])
    run = fabric_runs["atorch, loss / accumulation"]
    assert_off(run, references["llama"])
    assert len(run["warnings"]) == 1 and "atorch.with_count" in run["warnings"][0]


def test_atorch_fabric_strategy_skips_a_step_without_labels(fabric_runs):
    assert_the_empty_step_is_skipped(fabric_runs["empty step"], runs.serial("llama", empty=1))
