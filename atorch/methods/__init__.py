"""Optimization methods: one file each, registered on import.

To add one, write ``atorch/methods/<name>.py`` with a pydantic ``Config``, hook functions and a
``register_method(MethodSpec(...))`` call, then import it here.
"""

from atorch.methods import (  # noqa: F401
    amp_native,
    checkpoint,
    ds_3d_parallel,
    expert_parallel,
    fp8,
    fsdp,
    fused_optimizer,
    genomic_bottleneck,
    gradient_accumulation,
    half,
    mixed_parallel,
    module_replace,
    native_dynamo,
    parallel_mode,
    pipeline_parallel,
    tensor_parallel,
    zero1,
    zero2,
)
