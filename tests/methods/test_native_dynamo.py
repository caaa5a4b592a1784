import pytest

from atorch.auto import auto_accelerate
from atorch.errors import MethodConfigError
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, train_losses


def test_compiled_model_keeps_class_and_keys():
    model = TinyTransformer()
    keys = list(model.state_dict())
    _, result, _ = auto_accelerate(model, load_strategy=[("native_dynamo", "aot_eager")])
    assert type(result.model) is TinyTransformer and list(result.model.state_dict()) == keys
    assert result.model._compiled_call_impl is not None


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(MethodConfigError, match="unknown backend 'no_such'.*inductor"):
        auto_accelerate(TinyTransformer(), load_strategy=[("native_dynamo", {"backend": "no_such"})])


def test_compile_on_2_ranks_matches_eager_single_process():
    strategy = ["parallel_mode", ("native_dynamo", {"backend": "aot_eager"}), "checkpoint"]
    reference = train_losses([])
    results = run_distributed(train_losses, 2, strategy)
    assert_ranks_agree(results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
