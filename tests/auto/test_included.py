"""A method named in `included` is in the strategy that runs, or auto_accelerate refuses the job
with why: never dropped in silence."""

import pytest
import torch

from atorch import auto_accelerate
from atorch.errors import MethodConfigError
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def _accelerate(**kwargs):
    return auto_accelerate(TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss,
                           dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", **kwargs)


def test_an_included_method_that_cannot_run_here_is_refused_with_its_reason():
    with pytest.raises(MethodConfigError, match=r"included \['zero1'\] cannot be applied.*needs more than one "
                                                r"process.*remove it from `included`"):
        _accelerate(load_strategy=["amp_native"], included=["zero1"])


def test_an_included_method_that_runs_is_in_the_strategy():
    status, _, strategy = _accelerate(load_strategy=["amp_native"], included=["checkpoint"])
    assert status and "checkpoint" in strategy.opt_names
