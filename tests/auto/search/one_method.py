"""A search over plain DDP with and without one test-only method (two candidates), on every rank:
the shape of the tests that make one candidate misbehave on one rank."""

import torch

from atorch.auto.registry import MethodSpec, Stage, get_method, register_method

# Every registered method that a data-parallel search would try besides the one under test.
OTHERS = ["amp_native", "module_replace", "checkpoint", "gradient_accumulation", "zero1", "zero2", "fsdp",
          "pipeline_parallel",
          "tensor_parallel", "fused_optimizer", "native_dynamo"]


def search_with(name: str, config_cls, rewrite, description: str, report_file: str, dryrun_timeout: float):
    """Register ``name`` (its REWRITE hook ``rewrite``) once per process and run the search with it
    as the only extra; returns (status, the winner's method names or None)."""
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    try:
        get_method(name)
    except ValueError:
        register_method(MethodSpec(name, config_cls, {Stage.REWRITE: rewrite}, description,
                                   search_space=({"rank": 1},)))
    torch.manual_seed(0)
    status, _, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=report_file,
        excluded=OTHERS, dryrun_warmup_steps=1, dryrun_steps=2, dryrun_timeout=dryrun_timeout,
        use_search_cache=False,
    )
    return status, None if strategy is None else strategy.opt_names
