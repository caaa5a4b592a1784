import pytest
import torch
from torch import nn

from atorch.auto import auto_accelerate, register_replace_pair
from atorch.errors import MethodConfigError
from atorch.modules import FusedRMSNorm
from atorch.modules.replace import unregister_replace_pair
from tests.conftest import messages
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")

from tests.helpers.hf import tiny_llama, train_hf  # noqa: E402


def _eager_llama():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    return model


def test_hf_attention_switches_to_sdpa_with_the_same_outputs():
    ids = torch.randint(0, 96, (2, 12))
    eager = _eager_llama()
    expected = eager(input_ids=ids).logits
    keys = list(eager.state_dict())
    _, result, _ = auto_accelerate(eager, load_strategy=[("module_replace", {"pairs": ["hf_rmsnorm"]})])
    assert result.model.config._attn_implementation == "sdpa"
    assert list(result.model.state_dict()) == keys
    assert sum(isinstance(m, FusedRMSNorm) for m in result.model.modules()) == 5  # 2 per layer + final
    torch.testing.assert_close(result.model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_fused_rmsnorm_matches_hf_in_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32, eps=1e-5)
    nn.init.normal_(norm.weight)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(FusedRMSNorm.from_original(norm)(x), norm(x))


def test_default_pairs_depend_on_the_device(atorch_logs):
    _, result, _ = auto_accelerate(tiny_llama(), load_strategy=["module_replace"])
    fused = sum(isinstance(m, FusedRMSNorm) for m in result.model.modules())
    assert fused == (5 if torch.cuda.is_available() else 0)


class _Doubler(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    @classmethod
    def from_original(cls, linear):
        return cls(linear)

    def forward(self, x):
        return self.linear(x)


def test_user_pairs_respect_supported_dtypes(atorch_logs):
    register_replace_pair("test_linear", (nn.Linear, _Doubler), [torch.float32])
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_replace_pair("test_linear", (nn.Linear, _Doubler), [torch.float32])
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.float16))
        _, result, _ = auto_accelerate(model, load_strategy=[("module_replace", {"pairs": ["test_linear"]})])
        assert isinstance(result.model[0], _Doubler) and isinstance(result.model[1], nn.Linear)
        assert "replaced 1 modules (1 left: unsupported dtype)" in messages(atorch_logs)
    finally:
        unregister_replace_pair("test_linear")


def test_unknown_pair_lists_the_registered_ones():
    with pytest.raises(MethodConfigError, match="unknown replace pairs \\['nope'\\].*hf_rmsnorm"):
        auto_accelerate(tiny_llama(), load_strategy=[("module_replace", {"pairs": ["nope"]})])


def test_pair_without_from_original_is_refused():
    with pytest.raises(ValueError, match="from_original"):
        register_replace_pair("bad", (nn.Linear, nn.Identity))


def test_liger_kernels_where_they_cannot_run_are_dropped_with_the_reason_and_refused_when_included():
    from atorch.auto.environment import DeviceContext
    from atorch.auto.registry import get_method
    from atorch.methods.module_replace import ModuleReplaceConfig

    spec, config = get_method("module_replace"), ModuleReplaceConfig(kernels="liger")
    cpu = DeviceContext(1, 1, torch.device("cpu"), None, 2**34)
    assert "CUDA GPU" in spec.unsupported(cpu, config) and spec.unsupported(cpu, ModuleReplaceConfig()) is None
    cuda = DeviceContext(1, 1, torch.device("cuda", 0), None, 2**34)
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        assert "pip install 'atorch[liger]'" in spec.unsupported(cuda, config)
    if torch.cuda.is_available():
        return
    _, result, strategy = auto_accelerate(tiny_llama(), load_strategy=[("module_replace", {"kernels": "liger"})])
    assert "module_replace" not in strategy and any("CUDA GPU" in note for note in result.notes)
    with pytest.raises(MethodConfigError, match="module_replace.*CUDA GPU"):
        auto_accelerate(tiny_llama(), load_strategy=[("module_replace", {"kernels": "liger"})],
                        included=["module_replace"])


def test_module_replace_with_fsdp_on_2_ranks_matches_single_process():
    reference = train_hf([])
    strategy = ["parallel_mode", ("module_replace", {"pairs": ["hf_rmsnorm"]}), "fsdp"]
    results = run_distributed(train_hf, 2, strategy)
    assert_ranks_agree(results, train_hf([], micro_batches=2), FP32_RTOL)  # fsdp replicates nothing
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
